//! Archived sandboxes (`--auto-archive`): a container stopped long enough
//! is committed to an image `standby-archive:<sandbox id>`, labelled with
//! the sandbox id, the server's instance and when the container stopped,
//! and the container is removed. A Tier 1 resume makes the container again
//! from that image (slower than starting a stopped container: a create
//! first); the image stays while the container made from it exists, and
//! goes with the sandbox (its deletion, by age or by retirement).
//!
//! The engine keeps a stopped container's writable layer and its entry
//! (state, logs, network endpoint); an image keeps only the files, and
//! the sweeper can still find and age it by label.

use std::collections::HashMap;

use bollard::Docker;
use bollard::models::ContainerConfig;
use bollard::query_parameters::{CommitContainerOptions, ListImagesOptions, RemoveImageOptions};

use super::container::{self, INSTANCE_LABEL, SANDBOX_LABEL, docker_api_failed, not_found};
use crate::provider::ProviderError;

/// The repository of the archives' images.
const REPOSITORY: &str = "standby-archive";
/// Label holding when the archived container stopped (the engine's
/// `FinishedAt`): the delete-by-age counts from it.
pub(super) const STOPPED_AT_LABEL: &str = "standby.stopped-at";

/// The image a sandbox is archived to.
pub(super) fn image(sandbox_id: &str) -> String {
    format!("{REPOSITORY}:{sandbox_id}")
}

/// One archive's image of this instance.
#[derive(Debug, Clone)]
pub(super) struct Archive {
    pub sandbox_id: String,
    pub stopped_at: Option<String>,
}

/// Commits the stopped container to its archive image, then removes it.
pub(super) async fn archive(
    docker: &Docker,
    sandbox_id: &str,
    instance: &str,
    stopped_at: &str,
) -> Result<(), ProviderError> {
    let options = CommitContainerOptions {
        container: Some(container::name(sandbox_id)),
        repo: Some(REPOSITORY.to_owned()),
        tag: Some(sandbox_id.to_owned()),
        comment: Some("a stopped standby sandbox, archived by age".to_owned()),
        pause: false,
        ..Default::default()
    };
    let labels = HashMap::from([
        (SANDBOX_LABEL.to_owned(), sandbox_id.to_owned()),
        (INSTANCE_LABEL.to_owned(), instance.to_owned()),
        (STOPPED_AT_LABEL.to_owned(), stopped_at.to_owned()),
    ]);
    let config = ContainerConfig { labels: Some(labels), ..Default::default() };
    docker.commit_container(options, config).await.map_err(docker_api_failed(sandbox_id, "commit its container"))?;
    container::remove(docker, sandbox_id).await
}

/// Whether the sandbox has an archive image.
pub(super) async fn exists(docker: &Docker, sandbox_id: &str) -> Result<bool, ProviderError> {
    match docker.inspect_image(&image(sandbox_id)).await {
        Ok(_) => Ok(true),
        Err(error) if not_found(&error) => Ok(false),
        Err(error) => Err(docker_api_failed(sandbox_id, "inspect its archive image")(error)),
    }
}

/// Removes the archive image; a missing one is fine.
pub(super) async fn remove(docker: &Docker, sandbox_id: &str) -> Result<(), ProviderError> {
    let options = RemoveImageOptions { force: true, ..Default::default() };
    match docker.remove_image(&image(sandbox_id), Some(options), None).await {
        Ok(_) => Ok(()),
        Err(error) if not_found(&error) => Ok(()),
        Err(error) => Err(docker_api_failed(sandbox_id, "remove its archive image")(error)),
    }
}

/// Every archive image labelled with this server's instance.
pub(super) async fn own(docker: &Docker, instance: &str) -> Vec<Archive> {
    let filters = HashMap::from([(
        "label".to_owned(),
        vec![format!("{INSTANCE_LABEL}={instance}"), STOPPED_AT_LABEL.to_owned()],
    )]);
    let options = ListImagesOptions { filters: Some(filters), ..Default::default() };
    match docker.list_images(Some(options)).await {
        Ok(images) => images
            .into_iter()
            .filter_map(|summary| {
                let sandbox_id = summary.labels.get(SANDBOX_LABEL)?.clone();
                Some(Archive { sandbox_id, stopped_at: summary.labels.get(STOPPED_AT_LABEL).cloned() })
            })
            .collect(),
        Err(error) => {
            tracing::warn!(%error, "listing this server's archive images failed");
            Vec::new()
        }
    }
}
