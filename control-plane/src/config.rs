//! The configuration of `standby-server serve`, in one place: the flags
//! ([`flags`]), the file (`--config`, [`file`]), their merge with the source
//! of every value ([`merge`]), and the refusals that turn [`Settings`] into
//! one validated [`Config`], from which the server's, the engine's and the
//! provider's options are derived rather than copied by hand.
//!
//! Validation reads what the settings name (the spec, the API key file,
//! the cluster secret file) but changes nothing: making the data directory,
//! the secret key and the store is the start's, after it.

pub mod file;
pub mod flags;
pub mod merge;
#[cfg(test)]
mod tests;

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use merge::{Entry, LOG_ENV, Settings, Source};
use standby_protocol::{Secret, Spec};

use crate::cluster::ClusterConfig;
use crate::cluster::lease::LeaseTimes;
use crate::cluster::secret::{ClusterSecret, SecretFileError};
use crate::containment::ContainmentChoice;
use crate::listener::ListenerLimits;
use crate::policy::AutoStop;
use crate::policy::PoolPolicy;
use crate::provider::docker::snapshot::Retention;
use crate::provider::docker::{Allow, DockerOptions, Egress, Limits, OnStop};
use crate::provider::kubernetes::pod::{default_template, load_template};
use crate::provider::kubernetes::{KubernetesApi, KubernetesOptions};
use crate::provider::local::LocalOptions;
use crate::rules::RunBounds;
use crate::server::ServerConfig;
use crate::store::StoreLocation;
use flags::{ProviderKind, Serve, StoreArg};
use k8s_openapi::api::core::v1::PodTemplateSpec;

/// Why a configuration is refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read the configuration file {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file is not TOML, or holds an unknown key or a value of the
    /// wrong type: `standby.toml:7: unknown key ...`.
    #[error("{}{}: {message}", path.display(), line.map(|line| format!(":{line}")).unwrap_or_default())]
    File { path: PathBuf, line: Option<usize>, message: String },
    /// A file a setting names cannot be read.
    #[error("{what}")]
    Unreadable {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("--cluster-secret-file")]
    ClusterSecret(#[source] SecretFileError),
    /// A value, or a combination of them, that cannot be served with.
    #[error("{0}")]
    Invalid(String),
}

fn invalid<T>(message: impl Into<String>) -> Result<T, ConfigError> {
    Err(ConfigError::Invalid(message.into()))
}

/// A validated configuration: what `serve` starts with.
#[derive(Debug, Clone)]
pub struct Config {
    /// The store (unless `store` names one elsewhere), the secret key and
    /// the sandboxes.
    pub data_dir: PathBuf,
    pub store: StoreLocation,
    /// The key sealing run requests at rest.
    pub secret_key_file: PathBuf,
    pub server: ServerConfig,
    /// This replica's settings: every `serve` on a PostgreSQL store is
    /// one, and only those are.
    pub cluster: Option<ClusterConfig>,
    pub provider: ProviderConfig,
    /// The local and Docker providers' sweeper, in provider minutes.
    pub sweep: Sweep,
    /// Between SIGTERM and SIGKILL when a sandbox is stopped: the
    /// provider's, whoever asks it to stop one.
    pub stop_grace: Duration,
}

/// Where sandboxes come from, and what only that provider needs.
#[derive(Debug, Clone, PartialEq)]
pub enum ProviderConfig {
    /// An agent process per sandbox.
    Local(LocalConfig),
    /// A container per sandbox.
    Docker(DockerConfig),
    /// A Pod and a workspace claim per sandbox.
    Kubernetes(Box<KubernetesConfig>),
    /// No sandbox at all: standby credentials written to `dir`.
    Spool { dir: PathBuf },
}

/// The `local` provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalConfig {
    /// The `standby` binary every sandbox runs.
    pub agent: PathBuf,
    /// The directory of the sandboxes' directories.
    pub sandboxes: PathBuf,
    pub containment: ContainmentChoice,
}

/// The `docker` provider.
#[derive(Debug, Clone, PartialEq)]
pub struct DockerConfig {
    pub image: String,
    pub network: String,
    pub limits: Limits,
    pub on_stop: OnStop,
    pub egress: Egress,
    pub egress_allow: Vec<Allow>,
    pub runtime: Option<String>,
    pub snapshots: Retention,
}

/// The `kubernetes` provider.
#[derive(Debug, Clone, PartialEq)]
pub struct KubernetesConfig {
    pub namespace: Option<String>,
    /// The checked pod template.
    pub template: PodTemplateSpec,
    pub workspace_size: String,
    pub storage_class: Option<String>,
    /// The instance label; the data directory's instance id when `None`.
    pub instance: Option<String>,
    pub api: KubernetesApi,
    pub warm_pool: u32,
    /// The port of `--public-url`: agents' egress to the server.
    pub server_port: u16,
}

/// When a stopped sandbox is archived and deleted (`0`: never).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sweep {
    pub auto_archive: u32,
    pub auto_delete: u32,
}

impl Config {
    /// Every refusal of a start that needs no store: a missing key or
    /// agent, values that contradict each other, a replica's settings.
    pub fn validate(settings: &Settings) -> Result<Self, ConfigError> {
        let args = &settings.serve;
        let spec = read_spec(args.spec.as_deref())?;
        let api_key = api_key(args.api_key_file.as_deref(), args.api_key.as_ref())?;
        let provider = provider(args)?;
        let store = StoreArg::location(args.store.as_ref(), &args.data_dir);
        // A replica's settings and secret are checked before the database is touched.
        let cluster = matches!(store, StoreLocation::Postgres(_)).then(|| cluster(args)).transpose()?;
        let pool = &args.pool;
        if pool.running_cap != 0 && pool.running_cap < pool.pool_size {
            return invalid(format!(
                "--running-cap {} cannot hold --pool-size {} standbys: raise the cap (or 0 for none)",
                pool.running_cap, pool.pool_size
            ));
        }
        if pool.provider_minute.is_zero() {
            return invalid("--provider-minute must be longer than zero");
        }
        let sandbox = &args.sandbox;
        let mut server = ServerConfig::new(api_key, spec);
        server.listen = args.listen;
        server.public_url = args.public_url.clone();
        server.pool_size = pool.pool_size;
        server.heartbeat_interval = sandbox.heartbeat_interval;
        server.max_attempts = sandbox.max_attempts.max(1);
        server.launch_timeout = sandbox.launch_timeout;
        server.run_silence = sandbox.run_lost_after;
        server.linger = sandbox.linger;
        server.agent_log = sandbox.agent_log.clone();
        server.inject_latency = args.inject_latency;
        server.pool_policy = PoolPolicy {
            running_cap: pool.running_cap,
            max_preparing: pool.max_preparing,
            standby_ttl: pool.standby_ttl,
            warm_idle: pool.warm_idle,
            park_stopped: pool.park_stopped,
            auto_stop: AutoStop { minutes: pool.auto_stop, minute: pool.provider_minute },
            resume_timeout: pool.resume_timeout,
        };
        server.bounds = RunBounds {
            log_cap: args.bounds.log_cap.0,
            retention: args.bounds.run_retention,
            idempotency_window: args.bounds.idempotency_window,
        };
        server.listener = listener_limits(args)?;
        if let Some(endpoint) = &args.telemetry.otlp_endpoint {
            if let Err(error) = standby_otlp::traces_url(endpoint) {
                return invalid(format!("--otlp-endpoint: {error}"));
            }
            server.otlp_endpoint = Some(endpoint.trim().to_owned());
        }
        Ok(Self {
            data_dir: args.data_dir.clone(),
            store,
            secret_key_file: args.secret_key_file.clone().unwrap_or_else(|| args.data_dir.join("secret.key")),
            server,
            cluster,
            provider,
            sweep: Sweep { auto_archive: pool.auto_archive, auto_delete: pool.auto_delete },
            stop_grace: sandbox.stop_grace,
        })
    }

    /// The local provider's options: its own, with the provider minute,
    /// the sweep and the stop grace every provider shares.
    pub fn local_options(&self, local: &LocalConfig) -> LocalOptions {
        LocalOptions {
            minute: self.minute(),
            auto_archive: self.sweep.auto_archive,
            auto_delete: self.sweep.auto_delete,
            stop_grace: self.stop_grace,
            containment: local.containment,
        }
    }

    /// The Docker provider's options, as [`Config::local_options`], its
    /// containers labelled with `instance` (kept in the data directory).
    pub fn docker_options(&self, docker: &DockerConfig, instance: String) -> DockerOptions {
        DockerOptions {
            image: docker.image.clone(),
            network: docker.network.clone(),
            instance,
            limits: docker.limits,
            log_dir: self.data_dir.join("sandbox-logs"),
            minute: self.minute(),
            auto_archive: self.sweep.auto_archive,
            auto_delete: self.sweep.auto_delete,
            stop_grace: self.stop_grace,
            on_stop: docker.on_stop,
            egress: docker.egress,
            egress_allow: docker.egress_allow.clone(),
            runtime: docker.runtime.clone(),
            snapshots: docker.snapshots,
        }
    }

    /// The Kubernetes provider's options, as [`Config::docker_options`];
    /// `instance` is the data directory's, used when none is configured.
    pub fn kubernetes_options(&self, kubernetes: &KubernetesConfig, instance: String) -> KubernetesOptions {
        KubernetesOptions {
            namespace: kubernetes.namespace.clone(),
            template: kubernetes.template.clone(),
            workspace_size: kubernetes.workspace_size.clone(),
            storage_class: kubernetes.storage_class.clone(),
            instance: kubernetes.instance.clone().unwrap_or(instance),
            log_dir: self.data_dir.join("sandbox-logs"),
            minute: self.minute(),
            auto_archive: self.sweep.auto_archive,
            auto_delete: self.sweep.auto_delete,
            stop_grace: self.stop_grace,
            start_timeout: self.server.launch_timeout,
            api: kubernetes.api,
            warm_pool: kubernetes.warm_pool,
            server_port: kubernetes.server_port,
        }
    }

    /// How long a provider minute is: the pool policy's.
    fn minute(&self) -> Duration {
        self.server.pool_policy.auto_stop.minute
    }
}

fn read_spec(path: Option<&Path>) -> Result<Spec, ConfigError> {
    let Some(path) = path else { return Ok(Spec::default()) };
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Unreadable {
        what: format!("cannot read the spec file {}", path.display()),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| {
        ConfigError::Invalid(format!(
            "the spec file {} is not a valid spec: {}",
            path.display(),
            standby_protocol::describe_json_error(&e)
        ))
    })
}

/// The user API key, from its file or as given; never empty. A key file
/// that every local user can read is refused (the key is the whole user
/// API); one its group can read is taken with a warning, as a mounted
/// Kubernetes Secret with an `fsGroup` is.
fn api_key(file: Option<&Path>, given: Option<&Secret>) -> Result<Secret, ConfigError> {
    let key = match (file, given) {
        (Some(path), _) => {
            let read = |source| ConfigError::Unreadable {
                what: format!("cannot read the API key file {} (--api-key-file)", path.display()),
                source,
            };
            let mode = std::fs::metadata(path).map_err(read)?.permissions().mode() & 0o777;
            if mode & 0o007 != 0 {
                return invalid(format!(
                    "the API key file {} is readable by every user (mode {mode:o}): chmod 600 it (or 640 for its group)",
                    path.display()
                ));
            }
            if mode & 0o070 != 0 {
                tracing::warn!(path = %path.display(), mode = format!("{mode:o}"), "the API key file is readable by its group");
            }
            std::fs::read_to_string(path).map_err(read)?.trim().to_owned()
        }
        (None, Some(key)) => key.expose().trim().to_owned(),
        (None, None) => {
            return invalid(
                "the user API needs a key: --api-key-file <FILE> (STANDBY_SERVER_API_KEY_FILE) or STANDBY_SERVER_API_KEY",
            );
        }
    };
    if key.is_empty() {
        return match file {
            Some(path) => invalid(format!("the API key file {} is empty", path.display())),
            None => invalid("--api-key (STANDBY_SERVER_API_KEY) is empty"),
        };
    }
    Ok(Secret::new(key))
}

/// The `standby` agent: as given, else next to this executable.
pub fn agent_bin(given: Option<&Path>) -> Result<PathBuf, ConfigError> {
    if let Some(path) = given {
        return Ok(path.to_owned());
    }
    let exe = std::env::current_exe()
        .map_err(|source| ConfigError::Unreadable { what: "cannot find this executable's path".into(), source })?;
    Ok(exe.with_file_name("standby"))
}

/// An absolute path, so that a sandbox's agent finds it from its own
/// working directory.
fn absolute(path: &Path, what: &Path) -> Result<PathBuf, ConfigError> {
    std::path::absolute(path)
        .map_err(|source| ConfigError::Unreadable { what: format!("cannot resolve {}", what.display()), source })
}

fn provider(args: &Serve) -> Result<ProviderConfig, ConfigError> {
    Ok(match args.provider {
        ProviderKind::Local => {
            let agent = agent_bin(args.local.agent_bin.as_deref())?;
            if !agent.is_file() {
                return invalid(format!(
                    "the agent binary {} does not exist: build it (`cargo build --bins`) or pass --agent-bin",
                    agent.display()
                ));
            }
            let sandboxes = absolute(&args.data_dir.join("sandboxes"), &args.data_dir)?;
            ProviderConfig::Local(LocalConfig { agent, sandboxes, containment: args.local.sandbox_containment })
        }
        ProviderKind::Docker => {
            if args.listen.ip().is_loopback() {
                return invalid(format!(
                    "--provider docker: containers cannot reach the loopback address {}; listen on the gateway address \
                     of --docker-network `{}` or on 0.0.0.0 (--listen 0.0.0.0:{})",
                    args.listen,
                    args.docker.docker_network,
                    args.listen.port()
                ));
            }
            let docker = &args.docker;
            let store = StoreArg::location(args.store.as_ref(), &args.data_dir);
            if docker.on_stop == OnStop::Remove && matches!(store, StoreLocation::Postgres(_)) {
                return invalid(
                    "--on-stop remove: on a PostgreSQL store this server is a replica, whose stop leaves the \
                     sandboxes to the next leader (they are the cluster's), so it would remove nothing. Use \
                     --on-stop keep, and `standby-server prune` once the whole deployment is gone",
                );
            }
            ProviderConfig::Docker(DockerConfig {
                image: docker.image.clone(),
                network: docker.docker_network.clone(),
                limits: Limits {
                    cpus: docker.sandbox_cpus,
                    memory: docker.sandbox_memory.map(|bytes| bytes.0),
                    pids: docker.sandbox_pids,
                },
                on_stop: docker.on_stop,
                egress: docker.sandbox_egress,
                egress_allow: docker.sandbox_egress_allow.clone(),
                runtime: docker.sandbox_runtime.clone().filter(|runtime| !runtime.is_empty()),
                snapshots: Retention { keep: docker.snapshot_keep, max_age: docker.snapshot_max_age },
            })
        }
        ProviderKind::Kubernetes => {
            let Some(public_url) = &args.public_url else {
                return invalid(
                    "--provider kubernetes: the agents reach the server at --public-url (the Service's URL, \
                     such as http://standby.standby.svc:8080); set it",
                );
            };
            let server_port = reqwest::Url::parse(public_url)
                .ok()
                .and_then(|url| url.port_or_known_default())
                .ok_or_else(|| ConfigError::Invalid(format!("--public-url `{public_url}` is not an http(s) URL")))?;
            let kubernetes = &args.kubernetes;
            let template = match &kubernetes.kubernetes_pod_template {
                Some(path) => load_template(path, None).map_err(|error| ConfigError::Invalid(error.to_string()))?,
                None => default_template(&args.docker.image),
            };
            if let Some(instance) = &kubernetes.kubernetes_instance
                && !label_value(instance)
            {
                return invalid(format!(
                    "--kubernetes-instance `{instance}` is not a label value (63 letters, digits, `-`, `_` or `.` at most)"
                ));
            }
            ProviderConfig::Kubernetes(Box::new(KubernetesConfig {
                namespace: kubernetes.kubernetes_namespace.clone(),
                template,
                workspace_size: kubernetes.kubernetes_workspace_size.clone(),
                storage_class: kubernetes.kubernetes_storage_class.clone(),
                instance: kubernetes.kubernetes_instance.clone(),
                api: kubernetes.kubernetes_api,
                warm_pool: kubernetes.kubernetes_warm_pool,
                server_port,
            }))
        }
        ProviderKind::Spool => {
            let dir = args.spool.spool_dir.clone().unwrap_or_else(|| args.data_dir.join("spool"));
            ProviderConfig::Spool { dir: absolute(&dir, &dir)? }
        }
    })
}

/// Whether `text` is a Kubernetes label value.
fn label_value(text: &str) -> bool {
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    !text.is_empty()
        && text.len() <= 63
        && text.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && edge(text.chars().next())
        && edge(text.chars().last())
}

/// A replica's settings: every `serve` on a PostgreSQL store is one.
fn cluster(args: &Serve) -> Result<ClusterConfig, ConfigError> {
    let replica = &args.replica;
    let defaults = LeaseTimes::with_ttl(replica.lease_ttl);
    let times = LeaseTimes { renew_deadline: replica.renew_deadline.unwrap_or(defaults.renew_deadline), ..defaults };
    let times = times.check().map_err(|error| ConfigError::Invalid(error.to_string()))?;
    let replica_id = match &replica.replica_id {
        Some(id) if !id.trim().is_empty() => id.trim().to_owned(),
        Some(_) => return invalid("--replica-id is empty"),
        None => {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").ok();
            let host = host.as_deref().map(str::trim).filter(|host| !host.is_empty()).unwrap_or("replica");
            format!("{host}-{}", std::process::id())
        }
    };
    if let Some(url) = &replica.advertise_url
        && !url.starts_with("http://")
    {
        return invalid(format!("--advertise-url must be a plain http:// URL of this replica, not `{url}`"));
    }
    let Some(path) = &replica.cluster_secret_file else {
        return invalid(
            "a PostgreSQL store makes this server a replica: give the secret the replicas share with \
             --cluster-secret-file <FILE> (STANDBY_SERVER_CLUSTER_SECRET_FILE; docs/operations.md, \
             \"Replicated deployment\")",
        );
    };
    let secret = ClusterSecret::load(path).map_err(ConfigError::ClusterSecret)?;
    Ok(ClusterConfig { replica_id, advertise_url: replica.advertise_url.clone(), times, secret })
}

/// The listener's bounds: given, or derived from the open-files limit
/// (raise it first: `listener::raise_open_files_limit`).
fn listener_limits(args: &Serve) -> Result<ListenerLimits, ConfigError> {
    let given = &args.listener;
    if given.header_timeout.is_zero() {
        return invalid("--header-timeout must be longer than zero");
    }
    if given.body_timeout.is_zero() {
        return invalid("--body-timeout must be longer than zero");
    }
    let mut limits = ListenerLimits::for_open_files(crate::listener::open_files_limit());
    limits.header_timeout = given.header_timeout;
    limits.body_timeout = given.body_timeout;
    limits.max_pending_upgrades = given.max_pending_upgrades.max(1);
    if let Some(max) = given.max_connections {
        if max == 0 {
            return invalid("--max-connections must be at least 1");
        }
        limits.max_connections = max;
    }
    Ok(limits)
}
