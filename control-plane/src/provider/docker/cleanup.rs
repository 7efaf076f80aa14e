//! What a clean stop leaves behind (`--on-stop`), and the decisions,
//! pure, of what goes: the sandboxes of an instance to remove (every one
//! with a container or an archive image) and whether the sandboxes'
//! network may go. `prune.rs` takes the same decisions for an instance
//! whose server is gone.
//!
//! A crash (SIGKILL, a power cut) runs none of this: the containers and
//! images stay, for the next start on the same data directory to adopt,
//! or for `standby-server prune` to remove.

use std::collections::{BTreeSet, HashMap};

use bollard::Docker;
use bollard::query_parameters::ListContainersOptions;

use super::{DockerProvider, archive, container, sweeper};
use crate::provider::SandboxProvider as _;

/// The label a server puts on the sandboxes' network when it creates it.
pub const NETWORK_LABEL: &str = "standby.network";

/// What a clean stop (SIGTERM, SIGINT) of a Docker server leaves
/// (`--on-stop`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum OnStop {
    /// Every container of the instance stopped and kept, with its
    /// workspace; archive images kept: the next start on the same data
    /// directory adopts them.
    #[default]
    Keep,
    /// Every container of the instance (stopped first, within the stop
    /// grace) and its archive images removed, and the network when this
    /// server created it and no container is left on it.
    Remove,
}

/// What becomes of the sandboxes' network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetworkFate {
    Remove,
    /// Not the asker's to remove: not made by this server (a clean stop),
    /// or not labelled as made by a standby server (a prune).
    NotOurs,
    /// Containers (of any instance, running or stopped) are still on it.
    InUse(usize),
    /// It no longer exists.
    Missing,
}

/// Whether the network may go: `ours` says whether the asker may remove it
/// at all, `attached` how many containers, running or stopped, of any
/// instance, are still on it (a stopped container on a removed network
/// could not start again).
pub fn network_fate(exists: bool, ours: bool, attached: usize) -> NetworkFate {
    match (exists, ours, attached) {
        (false, _, _) => NetworkFate::Missing,
        (true, false, _) => NetworkFate::NotOurs,
        (true, true, 0) => NetworkFate::Remove,
        (true, true, n) => NetworkFate::InUse(n),
    }
}

/// The sandboxes to remove: every one with a container or an archive
/// image of the instance (an archived sandbox has an image and no
/// container; one resumed from its archive has both), once each, in order.
pub fn sandboxes_to_remove<'a>(
    containers: impl IntoIterator<Item = &'a str>,
    archives: impl IntoIterator<Item = &'a str>,
) -> Vec<String> {
    let all: BTreeSet<&str> = containers.into_iter().chain(archives).collect();
    all.into_iter().map(str::to_owned).collect()
}

/// The facts of a network: whether it exists, whether a standby server
/// labelled it as its own, and the ids of the containers (running or
/// stopped) on it.
pub(super) async fn network_facts(docker: &Docker, network: &str) -> Result<(bool, bool, Vec<String>), String> {
    let labelled = match docker.inspect_network(network, None).await {
        Ok(inspected) => inspected.labels.is_some_and(|labels| labels.contains_key(NETWORK_LABEL)),
        Err(error) if container::not_found(&error) => return Ok((false, false, Vec::new())),
        Err(error) => return Err(format!("cannot inspect the network `{network}`: {error}")),
    };
    let options = ListContainersOptions {
        all: true,
        filters: Some(HashMap::from([("network".to_owned(), vec![network.to_owned()])])),
        ..Default::default()
    };
    let attached = docker
        .list_containers(Some(options))
        .await
        .map_err(|error| format!("cannot list the containers on the network `{network}`: {error}"))?
        .into_iter()
        .filter_map(|summary| summary.id)
        .collect();
    Ok((true, labelled, attached))
}

/// Removes the network and its firewall rules; a missing one is fine.
pub async fn remove_network(docker: &Docker, network: &str) -> Result<(), String> {
    let bridge = docker.inspect_network(network, None).await.ok().as_ref().and_then(super::network::bridge_name);
    match docker.remove_network(network).await {
        Ok(()) => {}
        Err(error) if container::not_found(&error) => {}
        Err(error) => return Err(format!("cannot remove the network `{network}`: {error}")),
    }
    if let Some(bridge) = bridge {
        let _ = tokio::task::spawn_blocking(move || super::netfilter::remove(&bridge)).await;
    }
    Ok(())
}

/// `--on-stop remove`, after the running containers were stopped: every
/// container and archive image of this instance, its agents' logs, then
/// the network when this server made it and nothing is left on it. Under
/// the retention lock, so that the sweeper archives nothing meanwhile.
pub(super) async fn remove_on_stop(provider: &DockerProvider) {
    let inner = &provider.inner;
    let _retaining = inner.timers.retaining().await;
    let containers = sweeper::own_containers(inner).await;
    let archives = archive::own(&inner.docker, &inner.options.instance).await;
    let ids = sandboxes_to_remove(
        containers.iter().map(|own| own.sandbox_id.as_str()),
        archives.iter().map(|found| found.sandbox_id.as_str()),
    );
    let mut failed = 0;
    for id in &ids {
        match provider.delete(id).await {
            Ok(()) => tracing::info!(sandbox_id = id, "removed at stop (--on-stop remove)"),
            Err(error) => {
                failed += 1;
                tracing::warn!(sandbox_id = id, %error, "removing a sandbox at stop failed: it is left behind");
            }
        }
    }
    let network = &inner.options.network;
    let fate = match network_facts(&inner.docker, network).await {
        Ok((exists, _, attached)) => network_fate(exists, inner.network.made, attached.len()),
        Err(error) => {
            tracing::warn!(%error, "the network is left");
            return;
        }
    };
    match fate {
        NetworkFate::Remove => match remove_network(&inner.docker, network).await {
            Ok(()) => tracing::info!(network, "removed the sandboxes' network this server made"),
            Err(error) => tracing::warn!(%error, "the network is left"),
        },
        NetworkFate::InUse(attached) => tracing::info!(network, attached, "the network is left: containers use it"),
        NetworkFate::NotOurs => tracing::info!(network, "the network is left: this server did not create it"),
        NetworkFate::Missing => {}
    }
    tracing::info!(removed = ids.len() - failed, failed, "clean stop: this instance's sandboxes removed");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_network_goes_only_when_it_is_ours_and_nothing_is_on_it() {
        assert_eq!(network_fate(true, true, 0), NetworkFate::Remove);
        assert_eq!(network_fate(true, true, 2), NetworkFate::InUse(2), "another instance's container, even stopped");
        assert_eq!(network_fate(true, false, 0), NetworkFate::NotOurs, "an operator's network is never removed");
        assert_eq!(network_fate(false, true, 0), NetworkFate::Missing);
    }

    #[test]
    fn every_sandbox_with_a_container_or_an_archive_is_removed_once() {
        let removed = sandboxes_to_remove(["sbx_b", "sbx_a"], ["sbx_c", "sbx_a"]);
        assert_eq!(removed, ["sbx_a", "sbx_b", "sbx_c"]);
        assert!(sandboxes_to_remove([], []).is_empty());
    }

    #[test]
    fn keep_is_the_default() {
        assert_eq!(OnStop::default(), OnStop::Keep);
    }
}
