//! `standby-server prune`: what an old instance left on the engine (its
//! server stopped with `--on-stop keep`, crashed, or its data directory
//! gone): every container labelled `standby.instance=<id>`, running or
//! not, every image with that label (the archives, `archive.rs`), and,
//! when named, the sandboxes' network once no container is on it. Also
//! the list of the instances that have containers or images, with counts.
//!
//! Whether it may go is [`permission`]'s decision (pure): never the
//! instance of a server running on the data directory named, found by the
//! lock every `serve` holds on it (`crate::data_dir`).

use std::collections::{BTreeMap, HashMap};

use bollard::Docker;
use bollard::query_parameters::{ListContainersOptions, ListImagesOptions, RemoveContainerOptions, RemoveImageOptions};

use super::DockerError;
pub use super::cleanup::NetworkFate;
use super::cleanup::{network_facts, network_fate, remove_network};
use super::container::{INSTANCE_LABEL, SANDBOX_LABEL, not_found};

/// One container of the instance.
#[derive(Debug, Clone)]
pub struct FoundContainer {
    pub id: String,
    /// Its name, without the leading `/`.
    pub name: String,
    pub sandbox: Option<String>,
    pub running: bool,
}

/// One image of the instance (an archived sandbox).
#[derive(Debug, Clone)]
pub struct FoundImage {
    pub id: String,
    /// `standby-archive:<sandbox>`, or the id when untagged.
    pub name: String,
}

/// What the engine holds of one instance.
#[derive(Debug, Clone)]
pub struct Survey {
    pub instance: String,
    pub containers: Vec<FoundContainer>,
    pub images: Vec<FoundImage>,
}

impl Survey {
    pub fn running(&self) -> usize {
        self.containers.iter().filter(|found| found.running).count()
    }
}

/// The engine on its unix socket, answering.
pub async fn connect() -> Result<Docker, DockerError> {
    let docker = Docker::connect_with_unix_defaults().map_err(DockerError::Connect)?;
    docker.ping().await.map_err(DockerError::Connect)?;
    Ok(docker)
}

fn label_filter(label: String) -> Option<HashMap<String, Vec<String>>> {
    Some(HashMap::from([("label".to_owned(), vec![label])]))
}

/// Every container and image labelled with `instance`.
pub async fn survey(docker: &Docker, instance: &str) -> Result<Survey, String> {
    let label = format!("{INSTANCE_LABEL}={instance}");
    let options = ListContainersOptions { all: true, filters: label_filter(label.clone()), ..Default::default() };
    let containers = docker
        .list_containers(Some(options))
        .await
        .map_err(|error| format!("cannot list the containers of instance {instance}: {error}"))?
        .into_iter()
        .filter_map(|summary| {
            let id = summary.id?;
            let name = summary
                .names
                .unwrap_or_default()
                .first()
                .map_or_else(|| id.chars().take(12).collect(), |name| name.trim_start_matches('/').to_owned());
            let sandbox = summary.labels.and_then(|labels| labels.get(SANDBOX_LABEL).cloned());
            let running = summary.state.is_some_and(|state| state.to_string() == "running");
            Some(FoundContainer { id, name, sandbox, running })
        })
        .collect();
    let options = ListImagesOptions { filters: label_filter(label), ..Default::default() };
    let images = docker
        .list_images(Some(options))
        .await
        .map_err(|error| format!("cannot list the images of instance {instance}: {error}"))?
        .into_iter()
        .map(|summary| {
            let name = summary.repo_tags.first().cloned().unwrap_or_else(|| summary.id.clone());
            FoundImage { id: summary.id, name }
        })
        .collect();
    Ok(Survey { instance: instance.to_owned(), containers, images })
}

/// How much of one instance the engine holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub containers: usize,
    pub running: usize,
    pub images: usize,
}

/// The instances of the containers (their label, running or not) and
/// images (their label), with counts, by instance id.
pub fn count<'a>(
    containers: impl IntoIterator<Item = (&'a str, bool)>,
    images: impl IntoIterator<Item = &'a str>,
) -> BTreeMap<String, Counts> {
    let mut counts: BTreeMap<String, Counts> = BTreeMap::new();
    for (instance, running) in containers {
        let entry = counts.entry(instance.to_owned()).or_default();
        entry.containers += 1;
        entry.running += usize::from(running);
    }
    for instance in images {
        counts.entry(instance.to_owned()).or_default().images += 1;
    }
    counts
}

/// Every instance with a container or an image on the engine.
pub async fn instances(docker: &Docker) -> Result<BTreeMap<String, Counts>, String> {
    let filters = label_filter(INSTANCE_LABEL.to_owned());
    let options = ListContainersOptions { all: true, filters: filters.clone(), ..Default::default() };
    let containers =
        docker.list_containers(Some(options)).await.map_err(|error| format!("cannot list the containers: {error}"))?;
    let images = docker
        .list_images(Some(ListImagesOptions { filters, ..Default::default() }))
        .await
        .map_err(|error| format!("cannot list the images: {error}"))?;
    let containers: Vec<(String, bool)> = containers
        .into_iter()
        .filter_map(|summary| {
            let instance = summary.labels?.get(INSTANCE_LABEL)?.clone();
            Some((instance, summary.state.is_some_and(|state| state.to_string() == "running")))
        })
        .collect();
    let images: Vec<String> =
        images.into_iter().filter_map(|summary| summary.labels.get(INSTANCE_LABEL).cloned()).collect();
    Ok(count(
        containers.iter().map(|(instance, running)| (instance.as_str(), *running)),
        images.iter().map(String::as_str),
    ))
}

/// What the data directory named says of the instance to prune.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Guard {
    /// It is the data directory's instance, and a `serve` holds the
    /// directory's lock: its server runs.
    Running,
    /// It is the data directory's instance and no `serve` holds the lock
    /// (the prune holds it now: none starts until it is done).
    Stopped,
    /// It is not the data directory's instance: its server, if any, runs
    /// on another directory, which this prune cannot look at.
    Elsewhere,
}

/// Whether the prune may go on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Permission {
    Go,
    /// Refused: the instance runs, or may.
    Refused(String),
}

/// The rule: never the instance of a server running on the data directory
/// (`--force` does not change that); an instance of another directory
/// with running containers may be a live server's elsewhere, so it needs
/// `--force` (a crashed server leaves its containers running too).
pub fn permission(instance: &str, guard: Guard, running: usize, force: bool) -> Permission {
    match guard {
        Guard::Running => Permission::Refused(format!(
            "instance {instance} is the data directory's, and its server is running: stop it first (with \
             --on-stop remove, its clean stop removes what it made)"
        )),
        Guard::Stopped => Permission::Go,
        Guard::Elsewhere if running > 0 && !force => Permission::Refused(format!(
            "{running} container(s) of instance {instance} are running, and it is not the instance of --data-dir, \
             so whether its server runs cannot be checked: give its server's --data-dir, or --force once you know \
             the server is gone"
        )),
        Guard::Elsewhere => Permission::Go,
    }
}

/// What a prune did.
#[derive(Debug, Default)]
pub struct Report {
    pub containers: usize,
    pub images: usize,
    /// The network named, and what became of it.
    pub network: Option<(String, NetworkFate)>,
    /// Each failure, naming the instance and what could not be removed.
    pub failures: Vec<String>,
}

/// Removes what `survey` found (containers first: an image a container
/// was made from goes after it), then `network` when it is a standby
/// network with no container left on it. `progress` gets a line per step.
/// With `dry_run`, says what it would remove and removes nothing.
pub async fn remove(
    docker: &Docker,
    survey: &Survey,
    network: Option<&str>,
    dry_run: bool,
    progress: &mut dyn FnMut(String),
) -> Report {
    let instance = &survey.instance;
    let verb = if dry_run { "would remove" } else { "removed" };
    let mut report = Report::default();
    for found in &survey.containers {
        let state = if found.running { "running" } else { "stopped" };
        if !dry_run {
            let options = RemoveContainerOptions { force: true, v: true, ..Default::default() };
            match docker.remove_container(&found.id, Some(options)).await {
                Ok(()) => {}
                Err(error) if not_found(&error) => {}
                Err(error) => {
                    report.failures.push(format!(
                        "instance {instance}: cannot remove the container {} ({}): {error}",
                        found.name, found.id
                    ));
                    continue;
                }
            }
        }
        report.containers += 1;
        progress(format!("{verb} container {} ({state})", found.name));
    }
    for found in &survey.images {
        if !dry_run {
            let options = RemoveImageOptions { force: true, ..Default::default() };
            match docker.remove_image(&found.id, Some(options), None).await {
                Ok(_) => {}
                Err(error) if not_found(&error) => {}
                Err(error) => {
                    report.failures.push(format!(
                        "instance {instance}: cannot remove the image {} ({}): {error}",
                        found.name, found.id
                    ));
                    continue;
                }
            }
        }
        report.images += 1;
        progress(format!("{verb} image {}", found.name));
    }
    if let Some(network) = network {
        let fate = match network_facts(docker, network).await {
            Ok((exists, labelled, attached)) => {
                // A dry run removed nothing: the instance's own containers
                // would be gone.
                let others = attached.iter().filter(|id| !survey.containers.iter().any(|found| &found.id == *id));
                network_fate(exists, labelled, others.count())
            }
            Err(error) => {
                report.failures.push(format!("instance {instance}: {error}"));
                return report;
            }
        };
        let fate = match fate {
            NetworkFate::Remove if dry_run => fate,
            NetworkFate::Remove => match remove_network(docker, network).await {
                Ok(()) => fate,
                Err(error) => {
                    report.failures.push(format!("instance {instance}: {error}"));
                    return report;
                }
            },
            other => other,
        };
        progress(match fate {
            NetworkFate::Remove => format!("{verb} network {network}"),
            NetworkFate::InUse(attached) => format!("left network {network}: {attached} container(s) still on it"),
            NetworkFate::NotOurs => {
                format!("left network {network}: not made by a standby server (no {} label)", super::NETWORK_LABEL)
            }
            NetworkFate::Missing => format!("network {network} does not exist"),
        });
        report.network = Some((network.to_owned(), fate));
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_running_instance_of_the_data_directory_is_never_pruned() {
        assert!(matches!(permission("a1", Guard::Running, 0, false), Permission::Refused(_)));
        let refused = permission("a1", Guard::Running, 3, true);
        let Permission::Refused(why) = refused else { panic!("--force does not override a running server") };
        assert!(why.contains("a1") && why.contains("running"), "{why}");
        assert_eq!(permission("a1", Guard::Stopped, 2, false), Permission::Go, "the lock is free: crashed or stopped");
    }

    #[test]
    fn another_directorys_instance_with_running_containers_needs_force() {
        assert_eq!(permission("b2", Guard::Elsewhere, 0, false), Permission::Go);
        let Permission::Refused(why) = permission("b2", Guard::Elsewhere, 2, false) else { panic!("refused") };
        assert!(why.contains("2 container(s) of instance b2") && why.contains("--force"), "{why}");
        assert_eq!(permission("b2", Guard::Elsewhere, 2, true), Permission::Go);
    }

    #[test]
    fn instances_are_counted_by_their_label() {
        let counts = count([("a", true), ("a", false), ("b", false)], ["a", "c", "c"]);
        assert_eq!(counts["a"], Counts { containers: 2, running: 1, images: 1 });
        assert_eq!(counts["b"], Counts { containers: 1, running: 0, images: 0 });
        assert_eq!(counts["c"], Counts { containers: 0, running: 0, images: 2 });
        assert_eq!(counts.keys().collect::<Vec<_>>(), ["a", "b", "c"]);
    }
}
