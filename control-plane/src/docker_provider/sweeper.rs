//! The Docker provider's timers, applied: every quarter of a provider
//! minute, the containers labelled with this server's instance are listed;
//! a running one idle for its auto-stop is stopped, a stopped one older
//! than `auto_delete` is removed ([`super::timers`] decides both). Only
//! containers carrying this instance's label are ever touched.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use bollard::query_parameters::ListContainersOptions;

use super::{DockerInner, DockerProvider, container, lock, timers};
use crate::provider::SandboxProvider as _;

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
        } else if own.exited && options.auto_delete > 0 {
            let Ok(inspected) = inner.docker.inspect_container(&container::name(&id), None).await else { continue };
            let finished = inspected.state.and_then(|state| state.finished_at);
            let Some(age) = timers::stopped_for(finished.as_deref(), jiff::Timestamp::now()) else { continue };
            if timers::delete_stopped(options.auto_delete, age, options.minute) {
                tracing::info!(
                    sandbox_id = id,
                    minutes = options.auto_delete,
                    "stopped container removed by the sweeper"
                );
                if let Err(error) = provider.delete(&id).await {
                    tracing::warn!(%error, "the sweeper could not remove a stopped container");
                }
            }
        }
    }
}
