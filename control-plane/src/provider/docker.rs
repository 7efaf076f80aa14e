//! The `docker` provider (`standby-server serve --provider docker`): a
//! sandbox is a container of the Docker Engine on this machine, driven
//! through the Engine API over its unix socket (`bollard`), never the CLI.
//!
//! - **create**: a container from `--image` (`container.rs` says what it
//!   is), started with `standby hold` as its PID 1;
//! - **launch**: an exec of the agent, with a fresh standby credential on
//!   its standard input (`exec.rs`); the first launch, each Tier 2
//!   follow-up and each Tier 1 resume is one;
//! - **Tier 2** (a parked running sandbox): between turns the container
//!   keeps running; what the turn left is killed by its PID 1 ([`clear`]),
//!   and the next agent is a new exec, no restart;
//! - **stop** (Tier 1): `docker stop`, the filesystem kept; **start**
//!   starts the stopped container again; a removed one is missing, and a
//!   resume of it falls back to cold with the reason, as for `local`;
//! - **timers**: Docker has none, so the sweeper (`sweeper.rs`, the rules
//!   in `provider/timers.rs`, shared with `local`) stops idle containers, archives long-stopped ones to
//!   images (`archive.rs`; a resume makes the container again from its
//!   image) and removes them by age;
//! - **a clean stop** ([`SandboxProvider::stop_all`]) waits for the
//!   creates, starts and snapshot commits under way, then stops the
//!   running and paused containers, and with `--on-stop remove` removes every container and
//!   archive image of this instance and the network it made
//!   (`cleanup.rs` decides what goes; `prune.rs` does the same for an old
//!   instance, `standby-server prune`).
//!
//! A sandbox is [`Found::Running`] while an agent exec runs in its
//! container; a running container without one (Tier 2, between agents) is
//! [`Found::NoAgent`] to the dispatcher: it can take a fresh agent, and a
//! start leaves it running.
//!
//! [`clear`]: SandboxProvider::clear

mod archive;
mod cleanup;
mod container;
mod exec;
pub mod firewall;
mod netfilter;
mod network;
pub mod prune;
pub mod snapshot;
mod sweeper;

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bollard::Docker;
use bollard::query_parameters::{KillContainerOptions, TopOptions};
pub use cleanup::{NETWORK_LABEL, OnStop, remove_network};
pub use container::{INSTANCE_LABEL, Limits, SANDBOX_LABEL, SANDBOX_USER};
pub use exec::AGENT_PATH;
use firewall::Policy;
pub use firewall::{Allow, Egress};
pub use netfilter::NetfilterError;
use standby_protocol::Fingerprint;
use tokio::sync::watch;

use super::timers::Timers;
use super::{AgentLaunch, Details, Found, Launched, ProviderError, SandboxProvider, ensure_sweeper, lock, wait_done};

/// How many times a clean stop lists this instance's containers and stops
/// the live ones before it gives up (each round waits out the stop grace).
const STOP_ROUNDS: u32 = 3;

/// How the Docker provider makes and times its sandboxes.
#[derive(Debug, Clone)]
pub struct DockerOptions {
    /// The image every sandbox is created from (`--image`).
    pub image: String,
    /// The user-defined bridge network of the sandboxes
    /// (`--docker-network`), created when missing, inter-container traffic
    /// off.
    pub network: String,
    /// What the sandboxes reach beyond the server (`--sandbox-egress`).
    pub egress: Egress,
    /// What they reach whatever `egress` says (`--sandbox-egress-allow`).
    pub egress_allow: Vec<Allow>,
    /// This server's instance id: its containers carry it as a label.
    pub instance: String,
    pub limits: Limits,
    /// Where each sandbox's agent output is appended (`<id>.log`).
    pub log_dir: PathBuf,
    /// How long a provider minute is (auto-stop, delete).
    pub minute: Duration,
    /// Stopped for this many minutes: archived to an image (`0`: never).
    pub auto_archive: u32,
    /// Stopped for this many minutes: removed, archived or not (`0`: never).
    pub auto_delete: u32,
    /// Between SIGTERM and SIGKILL when the auto-stop stops a sandbox.
    pub stop_grace: Duration,
    /// What a clean stop leaves (`--on-stop`).
    pub on_stop: OnStop,
    /// The OCI runtime of the sandbox containers (`--sandbox-runtime`,
    /// such as gVisor's `runsc`); the Engine's default when `None`.
    pub runtime: Option<String>,
    /// Prepared snapshots kept (`--snapshot-keep`, `--snapshot-max-age`).
    pub snapshots: snapshot::Retention,
}

#[derive(Debug, thiserror::Error)]
pub enum DockerError {
    #[error("cannot reach the Docker Engine at its unix socket: {0}")]
    Connect(#[source] bollard::errors::Error),
    #[error("the sandbox image `{image}` is not in the engine (build it with scripts/image): {source}")]
    Image {
        image: String,
        #[source]
        source: bollard::errors::Error,
    },
    #[error("cannot {action} the network `{network}`: {source}")]
    Network {
        network: String,
        action: &'static str,
        #[source]
        source: bollard::errors::Error,
    },
    #[error("the network `{network}` has no IPv4 gateway to reach the server at")]
    NoGateway { network: String },
    #[error(
        "the network `{network}` cannot hold sandboxes: {why}. Name a new one with --docker-network (the server \
         makes it), or make it with `docker network create -o com.docker.network.bridge.enable_icc=false`"
    )]
    NotIsolated { network: String, why: String },
    #[error(
        "--sandbox-runtime `{runtime}` is not a runtime of the Docker Engine (it knows: {known}); register it in \
         the Engine's daemon.json `runtimes` and reload the Engine (docs/deploy.md, \"gVisor\")"
    )]
    UnknownRuntime { runtime: String, known: String },
    #[error("cannot ask the Docker Engine for its runtimes: {0}")]
    Info(#[source] bollard::errors::Error),
}

/// An agent exec this server started.
#[derive(Debug, Clone)]
struct Agent {
    exec_id: String,
    done: watch::Receiver<bool>,
}

/// Sandboxes as Docker containers.
#[derive(Debug, Clone)]
pub struct DockerProvider {
    inner: Arc<DockerInner>,
}

#[derive(Debug)]
struct DockerInner {
    docker: Docker,
    options: DockerOptions,
    /// The sandboxes' network (a clean stop with `--on-stop remove`
    /// removes it only when this server made it).
    network: network::Network,
    /// The port whose openings this server put in the network's firewall
    /// ([`SandboxProvider::serving`]), for its clean stop to take out.
    guarded: Mutex<Option<u16>>,
    agents: Mutex<HashMap<String, Agent>>,
    /// Idle auto-stop and retention; its lock keeps a start from a
    /// container being committed or removed under it.
    timers: Arc<Timers>,
    /// The id of `--image`: the snapshots grown from it are this server's.
    base_image: String,
    /// The snapshot tag of each fingerprint, grown from `base_image`.
    snapshots: Mutex<HashMap<String, String>>,
    /// One commit at a time: a commit pauses a container and writes a
    /// layer as large as its workspace.
    committing: tokio::sync::Mutex<()>,
    /// `true` once [`SandboxProvider::stop_all`] began. Held for reading by
    /// every create, start and snapshot, for writing by `stop_all`: it
    /// waits for the containers being started or committed, then no new
    /// one starts, so a clean stop leaves no container of this server
    /// running. A provider serves one
    /// server's life: a server started after it connects its own.
    closed: tokio::sync::RwLock<bool>,
}

impl DockerProvider {
    /// Connects to the engine, checks the image, and creates the network
    /// when missing.
    pub async fn connect(options: DockerOptions) -> Result<Self, DockerError> {
        let docker = Docker::connect_with_unix_defaults().map_err(DockerError::Connect)?;
        docker.ping().await.map_err(DockerError::Connect)?;
        let base_image = docker
            .inspect_image(&options.image)
            .await
            .map_err(|source| DockerError::Image { image: options.image.clone(), source })?
            .id
            .unwrap_or_default();
        if let Some(runtime) = &options.runtime {
            check_runtime(&docker, runtime).await?;
        }
        let network = network::ensure(&docker, &options.network).await?;
        std::fs::create_dir_all(&options.log_dir).ok();
        tracing::info!(
            network = options.network,
            bridge = network.bridge,
            gateway = %network.gateway,
            egress = ?options.egress,
            runtime = options.runtime.as_deref().unwrap_or("the engine's default"),
            image = options.image,
            on_stop = ?options.on_stop,
            "docker provider ready"
        );
        let timers = Timers::new(options.minute, options.auto_archive, options.auto_delete);
        // With --snapshot-keep 0 no sandbox starts from a snapshot, even
        // one another server left on the Engine.
        let snapshots =
            if options.snapshots.keep > 0 { known_snapshots(&docker, &base_image).await } else { HashMap::new() };
        Ok(Self {
            inner: Arc::new(DockerInner {
                docker,
                options,
                network,
                guarded: Mutex::new(None),
                agents: Mutex::new(HashMap::new()),
                timers,
                base_image,
                snapshots: Mutex::new(snapshots),
                committing: tokio::sync::Mutex::new(()),
                closed: tokio::sync::RwLock::new(false),
            }),
        })
    }

    /// The address containers reach the server at: the network's gateway.
    pub fn gateway(&self) -> Ipv4Addr {
        self.inner.network.gateway
    }

    /// What every sandbox container of this server shares.
    fn shape(&self) -> container::Shape<'_> {
        let options = &self.inner.options;
        container::Shape {
            network: &options.network,
            instance: &options.instance,
            limits: options.limits,
            runtime: options.runtime.as_deref(),
        }
    }

    /// The firewall of the sandboxes' network, as `--sandbox-egress` and
    /// its allow list say, with the host's resolvers.
    fn policy(&self) -> Policy {
        let options = &self.inner.options;
        Policy { egress: options.egress, allow: options.egress_allow.clone(), resolvers: host_resolvers() }
    }

    /// Creates and starts the sandbox's container from `image`.
    async fn create_from(&self, sandbox_id: &str, image: &str) -> Result<(), ProviderError> {
        self.ensure_sweeper();
        let closed = self.inner.closed.read().await;
        if *closed {
            return Err(ProviderError::Stopping { sandbox: sandbox_id.to_owned() });
        }
        let body = container::spec(image, sandbox_id, self.shape());
        container::create(&self.inner.docker, sandbox_id, body).await?;
        container::start(&self.inner.docker, sandbox_id).await
    }

    fn agent(&self, sandbox_id: &str) -> Option<Agent> {
        lock(&self.inner.agents).get(sandbox_id).cloned()
    }

    fn log_path(&self, sandbox_id: &str) -> PathBuf {
        self.inner.options.log_dir.join(format!("{sandbox_id}.log"))
    }

    fn ensure_sweeper(&self) {
        ensure_sweeper(&self.inner, &self.inner.timers, sweeper::sweep_once);
    }

    /// Whether the container runs, and the execs it has; `None` when it
    /// does not exist.
    async fn inspect(&self, sandbox_id: &str) -> Result<Option<(bool, Vec<String>)>, ProviderError> {
        match self.inner.docker.inspect_container(&container::name(sandbox_id), None).await {
            Ok(inspected) => {
                let running = inspected.state.and_then(|state| state.running).unwrap_or(false);
                Ok(Some((running, inspected.exec_ids.unwrap_or_default())))
            }
            Err(error) if container::not_found(&error) => Ok(None),
            Err(error) => Err(container::docker_api_failed(sandbox_id, "inspect its container")(error)),
        }
    }

    /// Waits until only the container's PID 1 is left, up to `timeout`.
    async fn only_pid_one(&self, sandbox_id: &str, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let top = self.inner.docker.top_processes(&container::name(sandbox_id), None::<TopOptions>).await;
            match top {
                Ok(top) if top.processes.as_ref().is_none_or(|processes| processes.len() <= 1) => return true,
                Err(_) => return true,
                Ok(_) if tokio::time::Instant::now() >= deadline => return false,
                Ok(_) => tokio::time::sleep(Duration::from_millis(25)).await,
            }
        }
    }
}

impl SandboxProvider for DockerProvider {
    async fn create(&self, sandbox_id: &str) -> Result<(), ProviderError> {
        self.create_from(sandbox_id, &self.inner.options.image).await
    }

    /// From the snapshot of `fingerprint` when one is kept; a snapshot
    /// removed behind this server's back is forgotten and the sandbox made
    /// from `--image`.
    async fn create_for(&self, sandbox_id: &str, fingerprint: &Fingerprint) -> Result<(), ProviderError> {
        let tag = lock(&self.inner.snapshots).get(fingerprint.as_str()).cloned();
        let Some(tag) = tag else { return self.create(sandbox_id).await };
        match self.create_from(sandbox_id, &snapshot::image(&tag)).await {
            Err(ProviderError::Docker { source, .. }) if container::not_found(&source) => {
                tracing::warn!(sandbox_id, tag, "the snapshot is gone: the sandbox is made from --image");
                lock(&self.inner.snapshots).remove(fingerprint.as_str());
                self.create(sandbox_id).await
            }
            created => {
                tracing::debug!(sandbox_id, tag, "sandbox made from its workspace's snapshot");
                created
            }
        }
    }

    fn snapshots(&self) -> bool {
        self.inner.options.snapshots.keep > 0
    }

    async fn snapshot(&self, sandbox_id: &str, fingerprint: &Fingerprint) -> Result<(), ProviderError> {
        if !self.snapshots() {
            return Ok(());
        }
        // A commit pauses the container: a clean stop waits for it to end
        // and no commit begins after the stop.
        let closed = self.inner.closed.read().await;
        if *closed {
            return Err(ProviderError::Stopping { sandbox: sandbox_id.to_owned() });
        }
        let _one_at_a_time = self.inner.committing.lock().await;
        if lock(&self.inner.snapshots).contains_key(fingerprint.as_str()) {
            return Ok(());
        }
        let started = Instant::now();
        let tag = snapshot::tag(fingerprint, &self.inner.base_image);
        snapshot::commit(&self.inner.docker, sandbox_id, fingerprint, &self.inner.base_image, &tag).await?;
        lock(&self.inner.snapshots).insert(fingerprint.to_string(), tag.clone());
        tracing::info!(sandbox_id, tag, elapsed_ms = started.elapsed().as_millis(), "prepared snapshot kept");
        snapshot::prune(&self.inner.docker, self.inner.options.snapshots).await;
        Ok(())
    }

    async fn start(&self, sandbox_id: &str) -> Result<(), ProviderError> {
        self.ensure_sweeper();
        let closed = self.inner.closed.read().await;
        if *closed {
            return Err(ProviderError::Stopping { sandbox: sandbox_id.to_owned() });
        }
        let _starting = self.inner.timers.starting().await;
        if self.inspect(sandbox_id).await?.is_some() {
            return container::start(&self.inner.docker, sandbox_id).await;
        }
        if !archive::exists(&self.inner.docker, sandbox_id).await? {
            return Err(ProviderError::Missing {
                sandbox: sandbox_id.to_owned(),
                path: PathBuf::from(format!("container {}", container::name(sandbox_id))),
            });
        }
        // Archived: the container is made again from its image.
        let image = archive::image(sandbox_id);
        let body = container::spec(&image, sandbox_id, self.shape());
        container::create(&self.inner.docker, sandbox_id, body).await?;
        container::start(&self.inner.docker, sandbox_id).await?;
        tracing::info!(sandbox_id, image, "archived sandbox's container made again from its image");
        Ok(())
    }

    async fn launch(&self, sandbox_id: &str, launch: AgentLaunch) -> Result<Launched, ProviderError> {
        let started = exec::start_agent(&self.inner.docker, sandbox_id, &launch, self.log_path(sandbox_id)).await?;
        lock(&self.inner.agents)
            .insert(sandbox_id.to_owned(), Agent { exec_id: started.exec_id.clone(), done: started.done.clone() });
        self.inner.timers.active(sandbox_id, Instant::now());
        tracing::info!(sandbox_id, exec_id = started.exec_id, "agent started by an exec");
        Ok(Launched { pid: None, exited: started.exited })
    }

    async fn stop(&self, sandbox_id: &str) {
        let grace = self.inner.options.stop_grace;
        if let Err(error) = container::stop(&self.inner.docker, sandbox_id, grace).await {
            tracing::warn!(%error, "stopping a sandbox's container failed");
        }
        if let Some(agent) = self.agent(sandbox_id) {
            wait_done(agent.done, Duration::from_secs(10)).await;
        }
        self.inner.timers.forget(sandbox_id);
    }

    async fn clear(&self, sandbox_id: &str) {
        let grace = self.inner.options.stop_grace;
        let signal = KillContainerOptions { signal: "SIGUSR1".to_owned() };
        let cleared = match self.inner.docker.kill_container(&container::name(sandbox_id), Some(signal)).await {
            Ok(()) => self.only_pid_one(sandbox_id, grace.max(Duration::from_secs(1))).await,
            Err(error) => {
                tracing::warn!(sandbox_id, %error, "asking a kept container's PID 1 to clear it failed");
                false
            }
        };
        if !cleared {
            tracing::warn!(sandbox_id, "a kept container could not be cleared: stopped instead");
            self.stop(sandbox_id).await;
        }
    }

    async fn wait_exit(&self, sandbox_id: &str, timeout: Duration) -> bool {
        if let Some(agent) = self.agent(sandbox_id) {
            return wait_done(agent.done, timeout).await;
        }
        // An agent this server did not start (adopted after a restart).
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if !matches!(self.state(sandbox_id).await, Ok(Found::Running)) {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    async fn delete(&self, sandbox_id: &str) -> Result<(), ProviderError> {
        container::remove(&self.inner.docker, sandbox_id).await?;
        archive::remove(&self.inner.docker, sandbox_id).await?;
        self.inner.timers.deleted(sandbox_id);
        lock(&self.inner.agents).remove(sandbox_id);
        let _ = tokio::fs::remove_file(self.log_path(sandbox_id)).await;
        Ok(())
    }

    async fn state(&self, sandbox_id: &str) -> Result<Found, ProviderError> {
        self.ensure_sweeper();
        let Some((running, exec_ids)) = self.inspect(sandbox_id).await? else {
            let archived = archive::exists(&self.inner.docker, sandbox_id).await?;
            return Ok(if archived { Found::Archived } else { Found::Missing });
        };
        if !running {
            return Ok(Found::NoAgent);
        }
        if let Some(agent) = self.agent(sandbox_id)
            && exec_ids.contains(&agent.exec_id)
        {
            return Ok(if *agent.done.borrow() { Found::NoAgent } else { Found::Running });
        }
        Ok(if exec::agent_running(&self.inner.docker, sandbox_id, &exec_ids).await {
            Found::Running
        } else {
            Found::NoAgent
        })
    }

    /// Stops every running or paused container of this instance (the stop
    /// grace each); with `--on-stop remove`, then removes every container
    /// and archive image of this instance, and the network when this server
    /// made it and no container is left on it.
    async fn stop_all(&self) {
        *self.inner.closed.write().await = true;
        // Listed again after each round: a container unpaused or started
        // behind this server's back (a commit ending, a start a killed
        // predecessor sent) between the listing and the stops is stopped
        // too, so a clean stop leaves none running.
        for round in 1..=STOP_ROUNDS {
            let own = sweeper::own_containers(&self.inner).await;
            let ids: Vec<String> = own.into_iter().filter(|c| c.live).map(|c| c.sandbox_id).collect();
            if ids.is_empty() {
                break;
            }
            if round > 1 {
                tracing::warn!(?ids, round, "containers still running after a round of stops: stopping them again");
            }
            futures::future::join_all(ids.iter().map(|id| self.stop(id))).await;
        }
        let guarded = lock(&self.inner.guarded).take();
        if let Some(port) = guarded {
            let (bridge, allow) = (self.inner.network.bridge.clone(), self.inner.options.egress_allow.clone());
            let _ = tokio::task::spawn_blocking(move || netfilter::release(&bridge, &allow, port)).await;
        }
        if self.inner.options.on_stop == OnStop::Remove {
            cleanup::remove_on_stop(self).await;
        }
    }

    async fn adopt(&self, known: HashSet<String>) {
        self.ensure_sweeper();
        for found in sweeper::own_containers(&self.inner).await {
            if known.contains(&found.sandbox_id) {
                tracing::info!(sandbox_id = found.sandbox_id, running = found.running, "adopted a container");
            } else {
                tracing::warn!(sandbox_id = found.sandbox_id, "removing an orphaned container of this server");
                if let Err(error) = container::remove(&self.inner.docker, &found.sandbox_id).await {
                    tracing::warn!(%error, "removing an orphaned container failed");
                }
            }
        }
        for found in archive::own(&self.inner.docker, &self.inner.options.instance).await {
            if !known.contains(&found.sandbox_id) {
                tracing::warn!(sandbox_id = found.sandbox_id, "removing an orphaned archive image of this server");
                if let Err(error) = archive::remove(&self.inner.docker, &found.sandbox_id).await {
                    tracing::warn!(%error, "removing an orphaned archive image failed");
                }
            }
        }
    }

    fn details(&self, _sandbox_id: &str) -> Details {
        Details::default()
    }

    async fn set_auto_stop(&self, sandbox_id: &str, minutes: u32) -> Result<(), ProviderError> {
        self.ensure_sweeper();
        self.inner.timers.set_auto_stop(sandbox_id, minutes);
        Ok(())
    }

    async fn auto_stop(&self, sandbox_id: &str) -> Result<Option<u32>, ProviderError> {
        Ok(self.inner.timers.auto_stop(sandbox_id))
    }

    fn touch(&self, sandbox_id: &str) {
        self.inner.timers.active(sandbox_id, Instant::now());
    }

    fn containment(&self) -> &'static str {
        "container"
    }

    fn agent_host(&self) -> Option<IpAddr> {
        Some(IpAddr::V4(self.inner.network.gateway))
    }

    /// Puts the network's firewall in place, open to `addr`'s port
    /// (`netfilter.rs`), before any sandbox is made.
    async fn serving(&self, addr: SocketAddr) -> Result<(), ProviderError> {
        if self.inner.options.egress == Egress::Unfiltered {
            tracing::warn!(
                network = self.inner.options.network,
                "--sandbox-egress unfiltered: the sandboxes reach whatever the host's own firewall lets through, \
                 the host included"
            );
            return Ok(());
        }
        let (bridge, policy, port) = (self.inner.network.bridge.clone(), self.policy(), addr.port());
        let network = self.inner.options.network.clone();
        tokio::task::spawn_blocking(move || netfilter::guard(&bridge, &policy, port))
            .await
            .map_err(|error| ProviderError::Firewall { network: network.clone(), message: error.to_string() })?
            .map_err(|error| ProviderError::Firewall { network, message: error.to_string() })?;
        *lock(&self.inner.guarded) = Some(port);
        tracing::info!(
            network = self.inner.options.network,
            egress = ?self.inner.options.egress,
            port,
            "the sandboxes' firewall is in place"
        );
        Ok(())
    }
}

/// The resolvers the Engine's DNS forwards sandbox queries to: the host's
/// (`/etc/resolv.conf`, or systemd-resolved's upstream list when the host
/// asks a local stub).
fn host_resolvers() -> Vec<Ipv4Addr> {
    let read = |path| std::fs::read_to_string(path).map(|text| firewall::resolvers(&text)).unwrap_or_default();
    let resolvers = read("/etc/resolv.conf");
    if resolvers.is_empty() { read("/run/systemd/resolve/resolv.conf") } else { resolvers }
}

/// The snapshots on the Engine grown from `base_image`, the newest of
/// each fingerprint.
async fn known_snapshots(docker: &Docker, base_image: &str) -> HashMap<String, String> {
    let mut listed = match snapshot::list(docker).await {
        Ok(listed) => listed,
        Err(error) => {
            tracing::warn!(%error, "listing the snapshot images failed: sandboxes start from --image");
            return HashMap::new();
        }
    };
    listed.sort_by_key(|snapshot| snapshot.made_at_ms);
    listed
        .into_iter()
        .filter(|snapshot| snapshot.base == base_image)
        .filter_map(|snapshot| {
            let tag = snapshot.image.split_once(':')?.1.to_owned();
            Some((snapshot.fingerprint, tag))
        })
        .collect()
}

/// Whether the Engine knows `runtime` (its `docker info` runtimes).
async fn check_runtime(docker: &Docker, runtime: &str) -> Result<(), DockerError> {
    let info = docker.info().await.map_err(DockerError::Info)?;
    let known: Vec<String> = info.runtimes.unwrap_or_default().into_keys().collect();
    if known.iter().any(|name| name == runtime) {
        return Ok(());
    }
    let mut known = known;
    known.sort();
    Err(DockerError::UnknownRuntime { runtime: runtime.to_owned(), known: known.join(", ") })
}
