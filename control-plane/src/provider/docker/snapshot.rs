//! Prepared snapshots (`--snapshot-keep`, docs/deploy.md "Prepared
//! snapshots"): the first pool standby of a fingerprint that is ready is
//! committed to an image `standby-snapshot:<fingerprint>-<base>`, and
//! later sandboxes of that fingerprint are created from it, so their agent
//! finds the workspace prepared (clone, setup) and only refreshes it.
//!
//! - **Keyed by what it holds**: the workspace's fingerprint (repository,
//!   ref, setup) and the id of the `--image` it grew from (the agent's
//!   version and everything else of the image): a changed spec or a
//!   rebuilt image makes a new snapshot; the old ones go by count and age
//!   ([`Retention`]), never while a container uses them (the Engine
//!   refuses, and the next prune tries again).
//! - **Nothing secret in it**: the machine holds the standby out of
//!   placement while it is committed, so no run has been near it; the
//!   standby credential came on an exec's standard input and is in no file;
//!   a workspace whose repository URL carries a credential is never
//!   snapshotted (`rules/snapshots.rs`). The container is paused for the
//!   commit, so no file is caught half-written.
//! - **The agent is told**: the image sets `STANDBY_SNAPSHOT` to the
//!   snapshot's tag, and an agent that finds the workspace prepared under
//!   a tag it has not refreshed for yet moves each untouched clone to its
//!   ref's head (the setup again when a commit changed) instead of using
//!   the snapshot's commit.
//!
//! Snapshots are not an instance's: replicas and later servers on the
//! same Engine and `--image` share them.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bollard::Docker;
use bollard::models::{ContainerConfig, ImageSummary};
use bollard::query_parameters::{CommitContainerOptions, ListImagesOptions, RemoveImageOptions};
use standby_protocol::{Fingerprint, vars};

use super::container::{self, docker_api_failed};
use crate::provider::ProviderError;

/// The repository of the snapshots' images.
const REPOSITORY: &str = "standby-snapshot";
/// Label holding the fingerprint of the workspace a snapshot holds.
pub(super) const FINGERPRINT_LABEL: &str = "standby.snapshot.fingerprint";
/// Label holding the id of the image the snapshot grew from.
pub(super) const BASE_LABEL: &str = "standby.snapshot.base";
/// Label holding when the snapshot was made (Unix milliseconds).
pub(super) const MADE_AT_LABEL: &str = "standby.snapshot.made-at";

/// How many snapshots are kept and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// Most snapshots kept (newest first); `0`: none is made.
    pub keep: usize,
    /// A snapshot older than this goes (`0`: no age limit).
    pub max_age: Duration,
}

/// The tag of the snapshot of `fingerprint` grown from the image `base`
/// (an image id, `sha256:…`): 16 hex digits of each, which tell snapshots
/// apart as long as fewer than billions exist.
pub(super) fn tag(fingerprint: &Fingerprint, base: &str) -> String {
    let base = base.strip_prefix("sha256:").unwrap_or(base);
    let short = |text: &str| text.chars().take(16).collect::<String>();
    format!("{}-{}", short(fingerprint.as_str()), short(base))
}

/// The image reference of a snapshot tag.
pub(super) fn image(tag: &str) -> String {
    format!("{REPOSITORY}:{tag}")
}

/// One snapshot image as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Listed {
    pub image: String,
    pub fingerprint: String,
    pub base: String,
    pub made_at_ms: u64,
}

impl Listed {
    /// A snapshot of this repository, by its tag and labels; `None` for
    /// any other image (an archive committed from a container that was
    /// made from a snapshot carries the snapshot's labels too).
    fn of(summary: &ImageSummary) -> Option<Self> {
        let image = summary.repo_tags.iter().find(|tag| tag.starts_with(&format!("{REPOSITORY}:")))?.clone();
        Some(Self {
            image,
            fingerprint: summary.labels.get(FINGERPRINT_LABEL)?.clone(),
            base: summary.labels.get(BASE_LABEL)?.clone(),
            made_at_ms: summary.labels.get(MADE_AT_LABEL).and_then(|ms| ms.parse().ok()).unwrap_or(0),
        })
    }
}

/// The snapshots to remove: beyond the `keep` newest, or older than
/// `max_age`. Pure: `now_ms` is passed in.
pub(super) fn expired(mut snapshots: Vec<Listed>, retention: Retention, now_ms: u64) -> Vec<Listed> {
    snapshots.sort_by(|a, b| b.made_at_ms.cmp(&a.made_at_ms).then_with(|| a.image.cmp(&b.image)));
    let max_age_ms = u64::try_from(retention.max_age.as_millis()).unwrap_or(u64::MAX);
    snapshots
        .into_iter()
        .enumerate()
        .filter(|(rank, listed)| {
            *rank >= retention.keep || (max_age_ms > 0 && now_ms.saturating_sub(listed.made_at_ms) > max_age_ms)
        })
        .map(|(_, listed)| listed)
        .collect()
}

/// Every snapshot image on the Engine.
pub(super) async fn list(docker: &Docker) -> Result<Vec<Listed>, bollard::errors::Error> {
    let filters = HashMap::from([("label".to_owned(), vec![FINGERPRINT_LABEL.to_owned(), BASE_LABEL.to_owned()])]);
    let options = ListImagesOptions { filters: Some(filters), ..Default::default() };
    Ok(docker.list_images(Some(options)).await?.iter().filter_map(Listed::of).collect())
}

/// Commits the prepared sandbox's container (paused meanwhile) as the
/// snapshot `tag` of `fingerprint` grown from `base`.
pub(super) async fn commit(
    docker: &Docker,
    sandbox_id: &str,
    fingerprint: &Fingerprint,
    base: &str,
    tag: &str,
) -> Result<(), ProviderError> {
    let options = CommitContainerOptions {
        container: Some(container::name(sandbox_id)),
        repo: Some(REPOSITORY.to_owned()),
        tag: Some(tag.to_owned()),
        comment: Some("a prepared standby sandbox: later sandboxes of its workspace start from it".to_owned()),
        pause: true,
        ..Default::default()
    };
    let made_at = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |since| since.as_millis());
    let labels = HashMap::from([
        (FINGERPRINT_LABEL.to_owned(), fingerprint.to_string()),
        (BASE_LABEL.to_owned(), base.to_owned()),
        (MADE_AT_LABEL.to_owned(), made_at.to_string()),
    ]);
    let config = ContainerConfig {
        labels: Some(labels),
        env: Some(vec![format!("{}={tag}", vars::SNAPSHOT)]),
        ..Default::default()
    };
    docker.commit_container(options, config).await.map_err(docker_api_failed(sandbox_id, "commit its container"))?;
    Ok(())
}

/// Removes the snapshots `retention` no longer keeps; one a container
/// still uses stays (the Engine refuses) until a later prune.
pub(super) async fn prune(docker: &Docker, retention: Retention) {
    let listed = match list(docker).await {
        Ok(listed) => listed,
        Err(error) => {
            tracing::warn!(%error, "listing the snapshot images failed");
            return;
        }
    };
    let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |since| since.as_millis());
    for old in expired(listed, retention, u64::try_from(now_ms).unwrap_or(u64::MAX)) {
        let options = RemoveImageOptions { force: false, ..Default::default() };
        match docker.remove_image(&old.image, Some(options), None).await {
            Ok(_) => tracing::info!(image = old.image, "removed an old snapshot"),
            Err(error) => tracing::debug!(image = old.image, %error, "an old snapshot stays for now (in use?)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listed(name: &str, made_at_ms: u64) -> Listed {
        Listed { image: image(name), fingerprint: name.into(), base: "b".into(), made_at_ms }
    }

    #[test]
    fn the_tag_names_the_fingerprint_and_the_base_image() {
        let fingerprint = standby_protocol::fingerprint(&standby_protocol::Workspace::default());
        let tag = tag(&fingerprint, "sha256:0123456789abcdef0123456789abcdef");
        assert_eq!(tag, format!("{}-0123456789abcdef", &fingerprint.as_str()[..16]));
        assert!(tag.len() <= 128 && tag.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'), "a valid tag");
    }

    #[test]
    fn snapshots_go_by_count_newest_kept_and_by_age() {
        let day = Duration::from_secs(86_400);
        let now = 10 * 86_400_000;
        let all = vec![listed("a", now - 1_000), listed("b", now - 3_000), listed("c", now - 2_000)];
        let keep_two = Retention { keep: 2, max_age: Duration::ZERO };
        assert_eq!(expired(all.clone(), keep_two, now), vec![listed("b", now - 3_000)]);

        let old = vec![listed("fresh", now - 1_000), listed("stale", now - 8 * 86_400_000)];
        let week = Retention { keep: 10, max_age: 7 * day };
        assert_eq!(expired(old, week, now), vec![listed("stale", now - 8 * 86_400_000)]);

        assert_eq!(expired(all, Retention { keep: 0, max_age: Duration::ZERO }, now).len(), 3);
    }

    #[test]
    fn only_images_of_the_snapshot_repository_are_snapshots() {
        let labels = HashMap::from([
            (FINGERPRINT_LABEL.to_owned(), "f".to_owned()),
            (BASE_LABEL.to_owned(), "b".to_owned()),
            (MADE_AT_LABEL.to_owned(), "7".to_owned()),
        ]);
        let summary = |tags: &[&str]| ImageSummary {
            repo_tags: tags.iter().map(|t| (*t).to_owned()).collect(),
            labels: labels.clone(),
            ..Default::default()
        };
        let snapshot = Listed::of(&summary(&["standby-snapshot:f-b"])).expect("a snapshot");
        assert_eq!((snapshot.fingerprint.as_str(), snapshot.base.as_str(), snapshot.made_at_ms), ("f", "b", 7));
        assert_eq!(Listed::of(&summary(&["standby-archive:sbx_1"])), None, "an archive of a snapshot's container");
    }
}
