//! The flags of `standby-server serve` (and `config`), one group per table
//! of the configuration file: `--pool-size` is `pool_size` in `[pool]`.
//! Every flag has an environment variable; clap applies flag > environment
//! > default, and [`super::merge`] puts the file between the last two.

use std::ffi::OsString;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::builder::TypedValueParser as _;
use standby_protocol::Secret;

use crate::containment::ContainmentChoice;
use crate::provider::docker::{Allow, Egress, OnStop};
use crate::provider::kubernetes::KubernetesApi;
use crate::store::StoreLocation;

/// `standby-server serve`: the whole configuration as flags.
#[derive(Debug, Clone, clap::Args)]
pub struct Serve {
    /// A configuration file (TOML, docs/operations.md, "Configuration
    /// file"): every flag is a key of it, in the table its heading names
    /// (`--pool-size` is `pool_size` in `[pool]`; the flags under Options
    /// are top-level keys). A flag or variable given overrides the file; an
    /// unknown key or a value of the wrong type stops the start, naming the
    /// file and the line. `standby-server config` shows the result.
    #[arg(long, env = "STANDBY_SERVER_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Address to listen on (HTTP and `/ws`).
    #[arg(long, env = "STANDBY_SERVER_LISTEN", default_value = "127.0.0.1:8080", value_name = "ADDR")]
    pub listen: SocketAddr,
    /// Base URL the agents are given; `http://<listen address>` when unset.
    #[arg(long, env = "STANDBY_SERVER_PUBLIC_URL", value_name = "URL")]
    pub public_url: Option<String>,
    /// Directory for the store (when --store is unset) and the local sandboxes.
    #[arg(long, env = "STANDBY_SERVER_DATA_DIR", default_value = "standby-data", value_name = "DIR")]
    pub data_dir: PathBuf,
    /// The store: a SQLite file (`<data dir>/standby.db` when unset), or a
    /// PostgreSQL URL (`postgres://user:password@host:5432/db`), best given
    /// through the variable: a command line is readable by every local user.
    #[arg(long, env = "STANDBY_SERVER_STORE", hide_env_values = true, value_name = "PATH|URL",
          value_parser = clap::builder::OsStringValueParser::new().map(StoreArg))]
    pub store: Option<StoreArg>,
    /// The standby spec (JSON, the shape of `GET /v1/standby/spec`); an
    /// empty workspace when unset.
    #[arg(long, env = "STANDBY_SERVER_SPEC", value_name = "FILE")]
    pub spec: Option<PathBuf>,
    /// A file holding the key of the user API (`Authorization: Bearer
    /// <key>`; surrounding whitespace ignored): the way to pass it, since a
    /// command line is readable by every local user.
    #[arg(long, env = "STANDBY_SERVER_API_KEY_FILE", value_name = "FILE", conflicts_with = "api_key")]
    pub api_key_file: Option<PathBuf>,
    /// The key of the user API itself; prefer --api-key-file (or this
    /// variable): other local users can read a command line. Never logged.
    #[arg(long, env = "STANDBY_SERVER_API_KEY", hide_env_values = true, value_name = "KEY",
          value_parser = |key: &str| Ok::<_, std::convert::Infallible>(Secret::new(key)))]
    pub api_key: Option<Secret>,
    /// The key that seals what runs are submitted with (secrets, cloud
    /// env, git passwords, attachments) in the store: 64 hex digits;
    /// `<data dir>/secret.key` when unset. On SQLite it is generated (mode
    /// 0600) when the file does not exist; on PostgreSQL every replica
    /// needs the same one, so it must exist (`standby-server keygen FILE`)
    /// and a key other than the store's is refused. Losing it loses only
    /// the requests of runs not finished yet.
    #[arg(long, env = "STANDBY_SERVER_SECRET_KEY_FILE", value_name = "FILE")]
    pub secret_key_file: Option<PathBuf>,
    /// Where sandboxes come from: `local` launches an agent per sandbox;
    /// `docker` makes a container per sandbox from --image on the Docker
    /// Engine of this machine (listen where containers reach: see
    /// --docker-network); `kubernetes` makes a Pod and a workspace claim per
    /// sandbox in a cluster (in-cluster, or KUBECONFIG; needs --public-url);
    /// `spool` launches nothing and writes each standby
    /// credential to `<spool dir>/<sandbox id>.token` for a load generator.
    #[arg(long, env = "STANDBY_SERVER_PROVIDER", default_value = "local", value_name = "PROVIDER")]
    pub provider: ProviderKind,
    /// Benchmarking: delay every agent call under `/v1/executions/` by this
    /// long, as a distant server would.
    #[arg(long, env = "STANDBY_SERVER_INJECT_LATENCY", default_value = "0s", value_parser = parse_duration, value_name = "DURATION")]
    pub inject_latency: Duration,
    #[command(flatten)]
    pub sandbox: SandboxArgs,
    #[command(flatten)]
    pub pool: PoolArgs,
    #[command(flatten)]
    pub local: LocalArgs,
    #[command(flatten)]
    pub docker: DockerArgs,
    #[command(flatten)]
    pub kubernetes: KubernetesArgs,
    #[command(flatten)]
    pub spool: SpoolArgs,
    #[command(flatten)]
    pub bounds: BoundsArgs,
    #[command(flatten)]
    pub listener: ListenerArgs,
    #[command(flatten)]
    pub replica: ReplicaArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

/// How agents are launched and timed, whatever the provider (`[sandbox]`).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Sandboxes ([sandbox])")]
pub struct SandboxArgs {
    /// Heartbeat interval the agents are launched with.
    #[arg(long, env = "STANDBY_SERVER_HEARTBEAT_INTERVAL", default_value = "15s", value_parser = parse_duration, value_name = "DURATION")]
    pub heartbeat_interval: Duration,
    /// Attempts per run, warm and cold together (at most one is warm).
    #[arg(long, env = "STANDBY_SERVER_MAX_ATTEMPTS", default_value_t = 3, value_name = "N")]
    pub max_attempts: u32,
    /// How long a new sandbox may take to connect.
    #[arg(long, env = "STANDBY_SERVER_LAUNCH_TIMEOUT", default_value = "2m", value_parser = parse_duration, value_name = "DURATION")]
    pub launch_timeout: Duration,
    /// How long a sandbox running a run may go unheard (no socket, no
    /// heartbeat) before its agent is taken for dead: the run fails, it is
    /// not run again, and the sandbox is stopped and deleted. Far longer
    /// than a live agent's reconnect (at most about a minute).
    #[arg(long, env = "STANDBY_SERVER_RUN_LOST_AFTER", default_value = "5m", value_parser = parse_duration, value_name = "DURATION")]
    pub run_lost_after: Duration,
    /// How long a finished, cancelled or retired sandbox may take to exit by itself.
    #[arg(long, env = "STANDBY_SERVER_LINGER", default_value = "30s", value_parser = parse_duration, value_name = "DURATION")]
    pub linger: Duration,
    /// Between SIGTERM and SIGKILL when stopping a sandbox.
    #[arg(long, env = "STANDBY_SERVER_STOP_GRACE", default_value = "10s", value_parser = parse_duration, value_name = "DURATION")]
    pub stop_grace: Duration,
    /// `STANDBY_LOG` of the agents (their output goes to `<sandbox>/agent.log`).
    #[arg(long, env = "STANDBY_SERVER_AGENT_LOG", default_value = "info", value_name = "FILTER")]
    pub agent_log: String,
}

/// The pool policy and the thread tiers (`docs/operations.md`; `[pool]`).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Pool ([pool])")]
pub struct PoolArgs {
    /// Standbys kept ready (`min_ready`).
    #[arg(long, visible_alias = "min-ready", env = "STANDBY_SERVER_POOL_SIZE", default_value_t = 2, value_name = "N")]
    pub pool_size: usize,
    /// Most sandboxes costing compute at once (standbys, busy, parked
    /// running); runs beyond it wait in order. `0`: no cap.
    #[arg(long, env = "STANDBY_SERVER_RUNNING_CAP", default_value_t = 16, value_name = "N")]
    pub running_cap: usize,
    /// Most pool standbys preparing at once (cloning, setting up): a pool
    /// that fills from nothing on a small machine prepares this many at a
    /// time instead of all at once. `0`: no bound.
    #[arg(long, env = "STANDBY_SERVER_MAX_PREPARING", default_value_t = 0, value_name = "N")]
    pub max_preparing: usize,
    /// A standby is replaced within this (jittered); `0s`: never.
    #[arg(long, env = "STANDBY_SERVER_STANDBY_TTL", default_value = "1h", value_parser = parse_duration, value_name = "DURATION")]
    pub standby_ttl: Duration,
    /// Tier 2: a thread's sandbox stays running this long after a turn;
    /// `0s`: not at all.
    #[arg(long, env = "STANDBY_SERVER_WARM_IDLE", default_value = "5m", value_parser = parse_duration, value_name = "DURATION")]
    pub warm_idle: Duration,
    /// Tier 1: keep a thread's sandbox stopped (filesystem kept) after its
    /// warm idle window, or at once; `false`: release it.
    #[arg(long, env = "STANDBY_SERVER_PARK_STOPPED", default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub park_stopped: bool,
    /// The provider's idle auto-stop, in provider minutes (`0`: never);
    /// raised to the warm idle window + 5 minutes for a sandbox kept warm.
    #[arg(long, env = "STANDBY_SERVER_AUTO_STOP", default_value_t = 15, value_name = "MINUTES")]
    pub auto_stop: u32,
    /// The local provider's sweeper: archive a sandbox stopped this long
    /// (`0`: never).
    #[arg(long, env = "STANDBY_SERVER_AUTO_ARCHIVE", default_value_t = 60, value_name = "MINUTES")]
    pub auto_archive: u32,
    /// The local provider's sweeper: delete a sandbox stopped this long
    /// (`0`: never).
    #[arg(long, env = "STANDBY_SERVER_AUTO_DELETE", default_value_t = 1440, value_name = "MINUTES")]
    pub auto_delete: u32,
    /// How long a provider minute is (auto-stop, archive, delete). Only
    /// tests shorten it.
    #[arg(long, env = "STANDBY_SERVER_PROVIDER_MINUTE", default_value = "60s", value_parser = parse_duration, value_name = "DURATION")]
    pub provider_minute: Duration,
    /// How long a resumed sandbox's agent may take to be ready before the
    /// run gets a fresh sandbox instead.
    #[arg(long, env = "STANDBY_SERVER_RESUME_TIMEOUT", default_value = "60s", value_parser = parse_duration, value_name = "DURATION")]
    pub resume_timeout: Duration,
}

/// The `local` provider (`[local]`).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Local provider ([local])")]
pub struct LocalArgs {
    /// The `standby` agent binary; `standby` next to this executable when unset.
    #[arg(long, env = "STANDBY_SERVER_AGENT_BIN", value_name = "PATH")]
    pub agent_bin: Option<PathBuf>,
    /// How the local provider keeps every process of a sandbox killable:
    /// `auto` probes for a cgroup, then a PID namespace (as root), then
    /// falls back to the process group with a warning; naming one fails the
    /// start where the host does not allow it.
    #[arg(long, env = "STANDBY_SERVER_SANDBOX_CONTAINMENT", default_value = "auto", value_name = "KIND")]
    pub sandbox_containment: ContainmentChoice,
}

/// The `docker` provider (`docs/deploy.md`, "Docker provider"; `[docker]`).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Docker provider ([docker])")]
pub struct DockerArgs {
    /// The image every sandbox container is created from (built by
    /// scripts/image).
    #[arg(long, env = "STANDBY_SERVER_IMAGE", default_value = "standby-sandbox:latest", value_name = "IMAGE")]
    pub image: String,
    /// The user-defined bridge network of the sandbox containers, created
    /// when missing. Containers reach the server at the network's gateway
    /// address: the server must listen there or on 0.0.0.0 (--listen).
    #[arg(long, env = "STANDBY_SERVER_DOCKER_NETWORK", default_value = "standby", value_name = "NAME")]
    pub docker_network: String,
    /// CPUs of each sandbox container (fractions allowed); none when unset.
    #[arg(long, env = "STANDBY_SERVER_SANDBOX_CPUS", value_name = "CPUS")]
    pub sandbox_cpus: Option<f64>,
    /// Memory of each sandbox container (`2GiB`), swap none beyond it; none when unset.
    #[arg(long, env = "STANDBY_SERVER_SANDBOX_MEMORY", value_parser = parse_bytes, value_name = "BYTES")]
    pub sandbox_memory: Option<Bytes>,
    /// Processes and threads of each sandbox container; none when unset.
    #[arg(long, env = "STANDBY_SERVER_SANDBOX_PIDS", value_name = "N")]
    pub sandbox_pids: Option<u64>,
    /// What a clean stop (SIGTERM, SIGINT) leaves: `keep` stops this
    /// instance's containers and keeps them and their archive images for
    /// the next start on the same data directory; `remove` removes them,
    /// and the network when this server created it and no container is
    /// left on it. A crash leaves everything (`standby-server prune`).
    /// Refused with a PostgreSQL store: replicas share the instance.
    #[arg(long, env = "STANDBY_SERVER_ON_STOP", default_value = "keep", value_name = "WHAT")]
    pub on_stop: OnStop,
    /// What a sandbox reaches besides this server's port (docs/deploy.md,
    /// "Isolation"): `public`, the public internet but no private, shared,
    /// loopback, link-local (cloud metadata) or reserved range and none of
    /// the host's other ports; `none`, nothing; `unfiltered`, no rules of
    /// the server's (the host's own firewall decides; for a server without
    /// root). Sandboxes never reach each other. `public` and `none` need
    /// root and iptables: the server manages chains on INPUT and DOCKER-USER
    /// for its network and removes them at its clean stop.
    #[arg(long, env = "STANDBY_SERVER_SANDBOX_EGRESS", default_value = "public", value_name = "WHAT")]
    pub sandbox_egress: Egress,
    /// An address or range, with an optional port, that sandboxes reach
    /// whatever --sandbox-egress says: `10.0.0.5:5432`, `192.168.7.0/24`, a
    /// service on the host at the gateway address (`172.18.0.1:9418`).
    /// Repeat the flag, or separate entries by commas; IPv4 only.
    #[arg(
        long,
        env = "STANDBY_SERVER_SANDBOX_EGRESS_ALLOW",
        value_delimiter = ',',
        value_name = "ADDRESS[/PREFIX][:PORT]"
    )]
    pub sandbox_egress_allow: Vec<Allow>,
    /// The OCI runtime of the sandbox containers, one the Engine knows
    /// (its daemon.json `runtimes`), such as gVisor's `runsc`: a kernel of
    /// its own between a run and the host's (docs/deploy.md, "gVisor").
    /// The Engine's default (runc) when unset. An unknown one fails the
    /// start, naming the ones the Engine knows.
    #[arg(long, env = "STANDBY_SERVER_SANDBOX_RUNTIME", value_name = "RUNTIME")]
    pub sandbox_runtime: Option<String>,
    /// Prepared snapshots kept on the Engine (docs/deploy.md, "Prepared
    /// snapshots"): the first standby of a workspace that is ready is
    /// committed to an image, and later standbys and cold sandboxes of that
    /// workspace start from it prepared. The newest N are kept; `0` makes
    /// none and every sandbox clones and sets up from nothing.
    #[arg(long, env = "STANDBY_SERVER_SNAPSHOT_KEEP", default_value_t = 4, value_name = "N")]
    pub snapshot_keep: usize,
    /// A snapshot older than this is removed (`0s`: no age limit); a
    /// workspace whose snapshot went is snapshotted again.
    #[arg(long, env = "STANDBY_SERVER_SNAPSHOT_MAX_AGE", default_value = "7d", value_parser = parse_duration, value_name = "DURATION")]
    pub snapshot_max_age: Duration,
}

/// The `kubernetes` provider (docs/deploy.md, "Kubernetes";
/// `[kubernetes]`).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Kubernetes provider ([kubernetes])")]
pub struct KubernetesArgs {
    /// The namespace of the sandbox Pods and claims; the client's own when
    /// unset (in a cluster, the server Pod's namespace).
    #[arg(long, env = "STANDBY_SERVER_KUBERNETES_NAMESPACE", value_name = "NAMESPACE")]
    pub kubernetes_namespace: Option<String>,
    /// The sandbox pod template: a PodTemplateSpec (YAML or JSON) with one
    /// container, such as a ConfigMap key mounted as a file. The server adds
    /// the `hold` argument, the workspace claim at /workspace and the strict
    /// settings, and refuses a template that holds a secret or weakens the
    /// sandbox. Unset: a Pod of --image and nothing else.
    #[arg(long, env = "STANDBY_SERVER_KUBERNETES_POD_TEMPLATE", value_name = "FILE")]
    pub kubernetes_pod_template: Option<PathBuf>,
    /// The size of each sandbox's workspace claim (a Kubernetes quantity).
    #[arg(long, env = "STANDBY_SERVER_KUBERNETES_WORKSPACE_SIZE", default_value = "10Gi", value_name = "QUANTITY")]
    pub kubernetes_workspace_size: String,
    /// The storage class of the workspace claims; the cluster's default when unset.
    #[arg(long, env = "STANDBY_SERVER_KUBERNETES_STORAGE_CLASS", value_name = "CLASS")]
    pub kubernetes_storage_class: Option<String>,
    /// The value of the `standby.dev/instance` label on everything this
    /// control plane makes, by which a restarted server adopts its Pods and
    /// never touches another's. Every replica of one control plane needs
    /// the same; `<data dir>/instance-id` when unset.
    #[arg(long, env = "STANDBY_SERVER_KUBERNETES_INSTANCE", value_name = "ID")]
    pub kubernetes_instance: Option<String>,
    /// What a sandbox is: `pods`, a Pod and a workspace claim of the
    /// server's own; `agent-sandbox`, a SandboxClaim of a warm pool of
    /// kubernetes-sigs/agent-sandbox (installed in the cluster), whose
    /// SandboxTemplate and SandboxWarmPool the server applies.
    #[arg(long, env = "STANDBY_SERVER_KUBERNETES_API", default_value = "pods", value_name = "API")]
    pub kubernetes_api: KubernetesApi,
    /// `agent-sandbox` only: the Sandboxes its SandboxWarmPool keeps
    /// started ahead of the claims.
    #[arg(long, env = "STANDBY_SERVER_KUBERNETES_WARM_POOL", default_value_t = 2, value_name = "N")]
    pub kubernetes_warm_pool: u32,
}

/// The `spool` provider (`[spool]`).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Spool provider ([spool])")]
pub struct SpoolArgs {
    /// The directory of the `spool` provider; `<data dir>/spool` when unset.
    #[arg(long, env = "STANDBY_SERVER_SPOOL_DIR", value_name = "DIR")]
    pub spool_dir: Option<PathBuf>,
}

/// What one run may cost (`docs/operations.md`, "Per-run bounds"; `[bounds]`).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Per-run bounds ([bounds])")]
pub struct BoundsArgs {
    /// Bytes of a run's log stored (`64MiB`, `512KiB`, `1000`); past it the
    /// run goes on, its output is acknowledged and counted, and the log
    /// ends with a line saying how many bytes were dropped.
    #[arg(long, env = "STANDBY_SERVER_LOG_CAP", default_value = "64MiB", value_parser = parse_bytes, value_name = "BYTES")]
    pub log_cap: Bytes,
    /// How long a finished run stays in memory; it stays in the store, and
    /// the API reads it from there after.
    #[arg(long, env = "STANDBY_SERVER_RUN_RETENTION", default_value = "10m", value_parser = parse_duration, value_name = "DURATION")]
    pub run_retention: Duration,
    /// How long an `Idempotency-Key` of `POST /v1/runs` is kept: a retry
    /// with the same key and body within it answers the run the first
    /// made; after it, the key is forgotten (and may make a new run).
    #[arg(long, env = "STANDBY_SERVER_IDEMPOTENCY_WINDOW", default_value = "24h", value_parser = parse_duration, value_name = "DURATION")]
    pub idempotency_window: Duration,
}

/// Bounds of the listener (`docs/operations.md`, "Listener limits"; `[listener]`).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Listener limits ([listener])")]
pub struct ListenerArgs {
    /// A connection must send a complete request head within this, and a
    /// kept-alive connection its next one; else it is closed.
    #[arg(long, env = "STANDBY_SERVER_HEADER_TIMEOUT", default_value = "10s", value_parser = parse_duration, value_name = "DURATION")]
    pub header_timeout: Duration,
    /// A request's body must arrive whole within this of its head; else it
    /// is answered `408` and the connection closed.
    #[arg(long, env = "STANDBY_SERVER_BODY_TIMEOUT", default_value = "30s", value_parser = parse_duration, value_name = "DURATION")]
    pub body_timeout: Duration,
    /// Descriptors held for connections at once: every connection (control
    /// sockets included), and on a follower each connection a forwarded
    /// call or relayed socket holds to the leader; more connections wait in
    /// the listen backlog. Default: the open-files limit (raised to its hard
    /// limit at start) minus a reserve of an eighth, at least 256.
    #[arg(long, env = "STANDBY_SERVER_MAX_CONNECTIONS", value_name = "N")]
    pub max_connections: Option<usize>,
    /// Control-socket upgrade requests being authenticated at once; more
    /// are answered `429` with `Retry-After`.
    #[arg(long, env = "STANDBY_SERVER_MAX_PENDING_UPGRADES", default_value_t = 256, value_name = "N")]
    pub max_pending_upgrades: usize,
}

/// A replica of a replicated deployment: every `serve` on one PostgreSQL
/// store (`docs/operations.md`, "Replicated deployment"; `[replica]`).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Replicas ([replica])")]
pub struct ReplicaArgs {
    /// How long the leader's lease runs without a renew (renewed every
    /// third of it): how long a dead leader's work waits for a new one.
    #[arg(long, env = "STANDBY_SERVER_LEASE_TTL", default_value = "10s", value_parser = parse_duration, value_name = "DURATION")]
    pub lease_ttl: Duration,
    /// How long a leader goes on leading without a successful renew, from
    /// the start of its last: below --lease-ttl (it stops before another
    /// replica can take the lease) and above a third of it; four fifths
    /// of --lease-ttl when unset.
    #[arg(long, env = "STANDBY_SERVER_RENEW_DEADLINE", value_parser = parse_duration, value_name = "DURATION")]
    pub renew_deadline: Option<Duration>,
    /// This replica's id; `<hostname>-<pid>` when unset.
    #[arg(long, env = "STANDBY_SERVER_REPLICA_ID", value_name = "ID")]
    pub replica_id: Option<String>,
    /// The URL other replicas reach this one at, to forward calls to it
    /// when it leads (plain http://, its own address, not a load
    /// balancer's); `http://<listen address>` when unset, which an
    /// unspecified address (0.0.0.0, ::) cannot be: then it is required.
    #[arg(long, env = "STANDBY_SERVER_ADVERTISE_URL", value_name = "URL")]
    pub advertise_url: Option<String>,
    /// A file (mode 0600, at least 32 bytes, e.g. `openssl rand -hex 32`)
    /// holding the secret every replica of the deployment shares: a
    /// follower forwards nothing to a leader that does not prove it.
    /// Required with a PostgreSQL store.
    #[arg(long, env = "STANDBY_SERVER_CLUSTER_SECRET_FILE", value_name = "FILE")]
    pub cluster_secret_file: Option<PathBuf>,
}

/// Traces (`docs/operations.md`, "Traces"; `[telemetry]`).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Traces ([telemetry])")]
pub struct TelemetryArgs {
    /// An OTLP/HTTP endpoint (`http(s)://collector:4318`; `/v1/traces` is
    /// appended unless the path ends with it): one trace per run start is
    /// exported there, and the agents are given it as
    /// STANDBY_OTLP_ENDPOINT (it must be reachable from the sandboxes).
    /// Unset: nothing is traced.
    #[arg(long, env = "STANDBY_SERVER_OTLP_ENDPOINT", value_name = "URL")]
    pub otlp_endpoint: Option<String>,
}

/// `--store` as given: a SQLite path (any bytes) or a PostgreSQL URL,
/// whose password `Debug` never shows.
#[derive(Clone, PartialEq, Eq)]
pub struct StoreArg(pub OsString);

impl StoreArg {
    /// The store it names, `data_dir` holding the default SQLite file.
    pub fn location(given: Option<&Self>, data_dir: &Path) -> StoreLocation {
        StoreLocation::from_arg(given.map(|store| store.0.clone()), data_dir)
    }
}

impl fmt::Debug for StoreArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&Self::location(Some(self), Path::new("")).describe())
    }
}

/// Where sandboxes come from (`--provider`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ProviderKind {
    Local,
    Docker,
    Kubernetes,
    Spool,
}

/// A byte count, written `1000`, `512KiB`, `64MiB` or `2GiB`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bytes(pub u64);

/// A byte count: a whole number, optionally followed by `KiB`, `MiB` or `GiB`.
pub fn parse_bytes(text: &str) -> Result<Bytes, String> {
    let text = text.trim();
    let (digits, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return Err(format!("`{text}` is not a byte count such as 1000, 512KiB or 64MiB")),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
        .map(Bytes)
        .ok_or_else(|| format!("`{text}` is not a byte count such as 1000, 512KiB or 64MiB"))
}

/// A duration such as `500ms`, `15s`, `2m` or `24h`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim())
        .map_err(|e| format!("`{text}` is not a duration such as 500ms, 15s or 2m ({e})"))
}
