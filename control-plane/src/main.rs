//! `standby-server`: the reference control plane (`serve`) and the demo
//! (`demo`). Thin: parses flags, sets up logging, calls the library; the
//! demo is the binary's own module, a client of the library.

mod demo;

use std::ffi::OsString;
use std::io::Write as _;
use std::net::SocketAddr;
use std::os::unix::fs::{DirBuilderExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use demo::{DemoOptions, Sandboxes};
use standby_control_plane::cluster::ClusterConfig;
use standby_control_plane::cluster::lease::LeaseTimes;
use standby_control_plane::cluster::secret::ClusterSecret;
use standby_control_plane::containment::ContainmentChoice;
use standby_control_plane::dispatch::{PoolPolicy, RunBounds};
use standby_control_plane::listener::{self, ListenerLimits};
use standby_control_plane::policy::AutoStop;
use standby_control_plane::provider::SandboxProvider;
use standby_control_plane::provider::docker::{DockerOptions, DockerProvider, Limits};
use standby_control_plane::provider::local::{LocalOptions, LocalProvider};
use standby_control_plane::provider::spool::SpoolProvider;
use standby_control_plane::seal::SealKey;
use standby_control_plane::server::{self, Ending, Replica, ServerConfig};
use standby_control_plane::store::{Opened, PostgresStore, StoreError, StoreLocation};
use standby_protocol::{Secret, Spec};
use tokio::signal::unix::{SignalKind, signal};

/// The reference control plane for `standby`: the server half of the
/// contract, a warm pool of standbys on a sandbox provider, and a demo.
#[derive(Debug, Parser)]
#[command(name = "standby-server", version, about, long_about)]
struct Cli {
    /// Log filter (tracing EnvFilter syntax); `RUST_LOG` is read when unset.
    #[arg(long = "log", global = true, env = "STANDBY_SERVER_LOG", value_name = "FILTER")]
    log_filter: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the server: HTTP API and control socket on one listener, the
    /// store, and a pool of local standbys.
    #[command(after_help = SERVE_EXIT_CODES)]
    Serve(Box<Serve>),
    /// Bring a PostgreSQL store's schema up to date, then exit: run it with
    /// the role that owns the schema, so that `serve` can run under a role
    /// that may only read and write rows (docs/operations.md, "Database
    /// roles"). `serve` does the same at start when its role may.
    Migrate(MigrateArgs),
    /// Show the whole system on this machine: a sample repository, two
    /// standbys, three runs (warm and cold), a table of what each took.
    Demo(DemoArgs),
    /// Write a new secret key (64 hex digits, mode 0600) to FILE, for
    /// `serve --secret-key-file`: replicas on one PostgreSQL store need
    /// the same one, made once beforehand. Never overwrites a file.
    Keygen {
        /// Where the key goes (its directory is made 0700 when missing).
        #[arg(value_name = "FILE")]
        path: PathBuf,
    },
}

#[derive(Debug, clap::Args)]
struct MigrateArgs {
    /// The PostgreSQL URL (`postgres://owner:password@host:5432/db`), best
    /// given through the variable: a command line is readable by every
    /// local user.
    #[arg(long, env = "STANDBY_SERVER_STORE", hide_env_values = true, value_name = "URL")]
    store: OsString,
}

/// How `serve` ends, for a supervisor (`docs/operations.md`).
const SERVE_EXIT_CODES: &str = "Exit codes:\n  0  stopped by SIGTERM or SIGINT\n  1  failed (flags, store, listener)\n  \
3  deposed: this replica led and lost the lease (another leads now); restart it, it comes back as a follower";

#[derive(Debug, clap::Args)]
struct Serve {
    /// Address to listen on (HTTP and `/ws`).
    #[arg(long, env = "STANDBY_SERVER_LISTEN", default_value = "127.0.0.1:8080", value_name = "ADDR")]
    listen: SocketAddr,
    /// Base URL the agents are given; `http://<listen address>` when unset.
    #[arg(long, env = "STANDBY_SERVER_PUBLIC_URL", value_name = "URL")]
    public_url: Option<String>,
    /// Directory for the store (when --store is unset) and the local sandboxes.
    #[arg(long, env = "STANDBY_SERVER_DATA_DIR", default_value = "standby-data", value_name = "DIR")]
    data_dir: PathBuf,
    /// The store: a SQLite file (`<data dir>/standby.db` when unset), or a
    /// PostgreSQL URL (`postgres://user:password@host:5432/db`), best given
    /// through the variable: a command line is readable by every local user.
    #[arg(long, env = "STANDBY_SERVER_STORE", hide_env_values = true, value_name = "PATH|URL")]
    store: Option<OsString>,
    /// Standbys kept ready (`min_ready`).
    #[arg(long, visible_alias = "min-ready", env = "STANDBY_SERVER_POOL_SIZE", default_value_t = 2, value_name = "N")]
    pool_size: usize,
    /// The standby spec (JSON, the shape of `GET /v1/standby/spec`); an
    /// empty workspace when unset.
    #[arg(long, env = "STANDBY_SERVER_SPEC", value_name = "FILE")]
    spec: Option<PathBuf>,
    /// A file holding the key of the user API (`Authorization: Bearer
    /// <key>`; surrounding whitespace ignored): the way to pass it, since a
    /// command line is readable by every local user.
    #[arg(long, env = "STANDBY_SERVER_API_KEY_FILE", value_name = "FILE", conflicts_with = "api_key")]
    api_key_file: Option<PathBuf>,
    /// The key of the user API itself; prefer --api-key-file (or this
    /// variable): other local users can read a command line. Never logged.
    #[arg(long, env = "STANDBY_SERVER_API_KEY", hide_env_values = true, value_name = "KEY")]
    api_key: Option<String>,
    /// The key that seals what runs are submitted with (secrets, cloud
    /// env, git passwords, attachments) in the store: 64 hex digits;
    /// `<data dir>/secret.key` when unset. On SQLite it is generated (mode
    /// 0600) when the file does not exist; on PostgreSQL every replica
    /// needs the same one, so it must exist (`standby-server keygen FILE`)
    /// and a key other than the store's is refused. Losing it loses only
    /// the requests of runs not finished yet.
    #[arg(long, env = "STANDBY_SERVER_SECRET_KEY_FILE", value_name = "FILE")]
    secret_key_file: Option<PathBuf>,
    /// The `standby` agent binary; `standby` next to this executable when unset.
    #[arg(long, env = "STANDBY_SERVER_AGENT_BIN", value_name = "PATH")]
    agent_bin: Option<PathBuf>,
    /// Heartbeat interval the agents are launched with.
    #[arg(long, env = "STANDBY_SERVER_HEARTBEAT_INTERVAL", default_value = "15s", value_parser = parse_duration, value_name = "DURATION")]
    heartbeat_interval: Duration,
    /// Attempts per run, warm and cold together (at most one is warm).
    #[arg(long, env = "STANDBY_SERVER_MAX_ATTEMPTS", default_value_t = 3, value_name = "N")]
    max_attempts: u32,
    /// How long a new sandbox may take to connect.
    #[arg(long, env = "STANDBY_SERVER_LAUNCH_TIMEOUT", default_value = "2m", value_parser = parse_duration, value_name = "DURATION")]
    launch_timeout: Duration,
    /// How long a sandbox running a run may go unheard (no socket, no
    /// heartbeat) before its agent is taken for dead: the run fails, it is
    /// not run again, and the sandbox is stopped and deleted. Far longer
    /// than a live agent's reconnect (at most about a minute).
    #[arg(long, env = "STANDBY_SERVER_RUN_LOST_AFTER", default_value = "5m", value_parser = parse_duration, value_name = "DURATION")]
    run_lost_after: Duration,
    /// How long a finished, cancelled or retired sandbox may take to exit by itself.
    #[arg(long, env = "STANDBY_SERVER_LINGER", default_value = "30s", value_parser = parse_duration, value_name = "DURATION")]
    linger: Duration,
    /// Between SIGTERM and SIGKILL when stopping a sandbox.
    #[arg(long, env = "STANDBY_SERVER_STOP_GRACE", default_value = "10s", value_parser = parse_duration, value_name = "DURATION")]
    stop_grace: Duration,
    /// `STANDBY_LOG` of the agents (their output goes to `<sandbox>/agent.log`).
    #[arg(long, env = "STANDBY_SERVER_AGENT_LOG", default_value = "info", value_name = "FILTER")]
    agent_log: String,
    /// Where sandboxes come from: `local` launches an agent per sandbox;
    /// `docker` makes a container per sandbox from --image on the Docker
    /// Engine of this machine (listen where containers reach: see
    /// --docker-network); `spool` launches nothing and writes each standby
    /// credential to `<spool dir>/<sandbox id>.token` for a load generator.
    #[arg(long, env = "STANDBY_SERVER_PROVIDER", default_value = "local", value_name = "PROVIDER")]
    provider: ProviderKind,
    #[command(flatten)]
    docker: DockerArgs,
    /// The directory of the `spool` provider; `<data dir>/spool` when unset.
    #[arg(long, env = "STANDBY_SERVER_SPOOL_DIR", value_name = "DIR")]
    spool_dir: Option<PathBuf>,
    /// Benchmarking: delay every agent call under `/v1/executions/` by this
    /// long, as a distant server would.
    #[arg(long, env = "STANDBY_SERVER_INJECT_LATENCY", default_value = "0s", value_parser = parse_duration, value_name = "DURATION")]
    inject_latency: Duration,
    #[command(flatten)]
    pool_policy: PoolPolicyArgs,
    #[command(flatten)]
    bounds: BoundsArgs,
    #[command(flatten)]
    limits: ListenerArgs,
    #[command(flatten)]
    replica: ReplicaArgs,
    /// How the local provider keeps every process of a sandbox killable:
    /// `auto` probes for a cgroup, then a PID namespace (as root), then
    /// falls back to the process group with a warning; naming one fails the
    /// start where the host does not allow it.
    #[arg(long, env = "STANDBY_SERVER_SANDBOX_CONTAINMENT", default_value = "auto", value_name = "KIND")]
    sandbox_containment: ContainmentChoice,
}

/// The `docker` provider (`docs/deploy.md`, "Docker provider").
#[derive(Debug, clap::Args)]
struct DockerArgs {
    /// The image every sandbox container is created from (built by
    /// scripts/image).
    #[arg(long, env = "STANDBY_SERVER_IMAGE", default_value = "standby-sandbox:latest", value_name = "IMAGE")]
    image: String,
    /// The user-defined bridge network of the sandbox containers, created
    /// when missing. Containers reach the server at the network's gateway
    /// address: the server must listen there or on 0.0.0.0 (--listen).
    #[arg(long, env = "STANDBY_SERVER_DOCKER_NETWORK", default_value = "standby", value_name = "NAME")]
    docker_network: String,
    /// CPUs of each sandbox container (fractions allowed); none when unset.
    #[arg(long, env = "STANDBY_SERVER_SANDBOX_CPUS", value_name = "CPUS")]
    sandbox_cpus: Option<f64>,
    /// Memory of each sandbox container (`2GiB`), swap none beyond it; none when unset.
    #[arg(long, env = "STANDBY_SERVER_SANDBOX_MEMORY", value_parser = parse_bytes, value_name = "BYTES")]
    sandbox_memory: Option<u64>,
    /// Processes and threads of each sandbox container; none when unset.
    #[arg(long, env = "STANDBY_SERVER_SANDBOX_PIDS", value_name = "N")]
    sandbox_pids: Option<u64>,
}

/// What one run may cost (`docs/operations.md`, "Per-run bounds").
#[derive(Debug, clap::Args)]
struct BoundsArgs {
    /// Bytes of a run's log stored (`64MiB`, `512KiB`, `1000`); past it the
    /// run goes on, its output is acknowledged and counted, and the log
    /// ends with a line saying how many bytes were dropped.
    #[arg(long, env = "STANDBY_SERVER_LOG_CAP", default_value = "64MiB", value_parser = parse_bytes, value_name = "BYTES")]
    log_cap: u64,
    /// How long a finished run stays in memory; it stays in the store, and
    /// the API reads it from there after.
    #[arg(long, env = "STANDBY_SERVER_RUN_RETENTION", default_value = "10m", value_parser = parse_duration, value_name = "DURATION")]
    run_retention: Duration,
    /// How long an `Idempotency-Key` of `POST /v1/runs` is kept: a retry
    /// with the same key and body within it answers the run the first
    /// made; after it, the key is forgotten (and may make a new run).
    #[arg(long, env = "STANDBY_SERVER_IDEMPOTENCY_WINDOW", default_value = "24h", value_parser = parse_duration, value_name = "DURATION")]
    idempotency_window: Duration,
}

/// A replica of a replicated deployment: every `serve` on one PostgreSQL
/// store (`docs/operations.md`, "Replicated deployment").
#[derive(Debug, clap::Args)]
struct ReplicaArgs {
    /// How long the leader's lease runs without a renew (renewed every
    /// third of it): how long a dead leader's work waits for a new one.
    #[arg(long, env = "STANDBY_SERVER_LEASE_TTL", default_value = "10s", value_parser = parse_duration, value_name = "DURATION")]
    lease_ttl: Duration,
    /// How long a leader goes on leading without a successful renew, from
    /// the start of its last: below --lease-ttl (it stops before another
    /// replica can take the lease) and above a third of it; four fifths
    /// of --lease-ttl when unset.
    #[arg(long, env = "STANDBY_SERVER_RENEW_DEADLINE", value_parser = parse_duration, value_name = "DURATION")]
    renew_deadline: Option<Duration>,
    /// This replica's id; `<hostname>-<pid>` when unset.
    #[arg(long, env = "STANDBY_SERVER_REPLICA_ID", value_name = "ID")]
    replica_id: Option<String>,
    /// The URL other replicas reach this one at, to forward calls to it
    /// when it leads (plain http://, its own address, not a load
    /// balancer's); `http://<listen address>` when unset, which an
    /// unspecified address (0.0.0.0, ::) cannot be: then it is required.
    #[arg(long, env = "STANDBY_SERVER_ADVERTISE_URL", value_name = "URL")]
    advertise_url: Option<String>,
    /// A file (mode 0600, at least 32 bytes, e.g. `openssl rand -hex 32`)
    /// holding the secret every replica of the deployment shares: a
    /// follower forwards nothing to a leader that does not prove it.
    /// Required with a PostgreSQL store.
    #[arg(long, env = "STANDBY_SERVER_CLUSTER_SECRET_FILE", value_name = "FILE")]
    cluster_secret_file: Option<PathBuf>,
}

impl ReplicaArgs {
    fn cluster(self) -> anyhow::Result<ClusterConfig> {
        let defaults = LeaseTimes::with_ttl(self.lease_ttl);
        let times = LeaseTimes { renew_deadline: self.renew_deadline.unwrap_or(defaults.renew_deadline), ..defaults };
        let times = times.check()?;
        let replica_id = match self.replica_id {
            Some(id) if !id.trim().is_empty() => id.trim().to_owned(),
            Some(_) => anyhow::bail!("--replica-id is empty"),
            None => {
                let host = std::fs::read_to_string("/proc/sys/kernel/hostname").ok();
                let host = host.as_deref().map(str::trim).filter(|host| !host.is_empty()).unwrap_or("replica");
                format!("{host}-{}", std::process::id())
            }
        };
        if let Some(url) = &self.advertise_url
            && !url.starts_with("http://")
        {
            anyhow::bail!("--advertise-url must be a plain http:// URL of this replica, not `{url}`");
        }
        let Some(path) = self.cluster_secret_file else {
            anyhow::bail!(
                "a PostgreSQL store makes this server a replica: give the secret the replicas share with \
                 --cluster-secret-file <FILE> (STANDBY_SERVER_CLUSTER_SECRET_FILE; docs/operations.md, \
                 \"Replicated deployment\")"
            );
        };
        let secret = ClusterSecret::load(&path).context("--cluster-secret-file")?;
        Ok(ClusterConfig { replica_id, advertise_url: self.advertise_url, times, secret })
    }
}

/// Bounds of the listener (`docs/operations.md`, "Listener limits").
#[derive(Debug, clap::Args)]
struct ListenerArgs {
    /// A connection must send a complete request head within this, and a
    /// kept-alive connection its next one; else it is closed.
    #[arg(long, env = "STANDBY_SERVER_HEADER_TIMEOUT", default_value = "10s", value_parser = parse_duration, value_name = "DURATION")]
    header_timeout: Duration,
    /// A request's body must arrive whole within this of its head; else it
    /// is answered `408` and the connection closed.
    #[arg(long, env = "STANDBY_SERVER_BODY_TIMEOUT", default_value = "30s", value_parser = parse_duration, value_name = "DURATION")]
    body_timeout: Duration,
    /// Descriptors held for connections at once: every connection (control
    /// sockets included), and on a follower each connection a forwarded
    /// call or relayed socket holds to the leader; more connections wait in
    /// the listen backlog. Default: the open-files limit (raised to its hard
    /// limit at start) minus a reserve of an eighth, at least 256.
    #[arg(long, env = "STANDBY_SERVER_MAX_CONNECTIONS", value_name = "N")]
    max_connections: Option<usize>,
    /// Control-socket upgrade requests being authenticated at once; more
    /// are answered `429` with `Retry-After`.
    #[arg(long, env = "STANDBY_SERVER_MAX_PENDING_UPGRADES", default_value_t = 256, value_name = "N")]
    max_pending_upgrades: usize,
}

impl ListenerArgs {
    fn limits(&self) -> anyhow::Result<ListenerLimits> {
        if self.header_timeout.is_zero() {
            anyhow::bail!("--header-timeout must be longer than zero");
        }
        if self.body_timeout.is_zero() {
            anyhow::bail!("--body-timeout must be longer than zero");
        }
        let open_files = listener::raise_open_files_limit();
        let mut limits = ListenerLimits::for_open_files(open_files);
        limits.header_timeout = self.header_timeout;
        limits.body_timeout = self.body_timeout;
        limits.max_pending_upgrades = self.max_pending_upgrades.max(1);
        if let Some(max) = self.max_connections {
            if max == 0 {
                anyhow::bail!("--max-connections must be at least 1");
            }
            limits.max_connections = max;
        }
        Ok(limits)
    }
}

/// The pool policy and the thread tiers (`docs/operations.md`).
#[derive(Debug, clap::Args)]
struct PoolPolicyArgs {
    /// Most sandboxes costing compute at once (standbys, busy, parked
    /// running); runs beyond it wait in order. `0`: no cap.
    #[arg(long, env = "STANDBY_SERVER_RUNNING_CAP", default_value_t = 16, value_name = "N")]
    running_cap: usize,
    /// A standby is replaced within this (jittered); `0s`: never.
    #[arg(long, env = "STANDBY_SERVER_STANDBY_TTL", default_value = "1h", value_parser = parse_duration, value_name = "DURATION")]
    standby_ttl: Duration,
    /// Tier 2: a thread's sandbox stays running this long after a turn;
    /// `0s`: not at all.
    #[arg(long, env = "STANDBY_SERVER_WARM_IDLE", default_value = "5m", value_parser = parse_duration, value_name = "DURATION")]
    warm_idle: Duration,
    /// Tier 1: keep a thread's sandbox stopped (filesystem kept) after its
    /// warm idle window, or at once; `false`: release it.
    #[arg(long, env = "STANDBY_SERVER_PARK_STOPPED", default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    park_stopped: bool,
    /// The provider's idle auto-stop, in provider minutes (`0`: never);
    /// raised to the warm idle window + 5 minutes for a sandbox kept warm.
    #[arg(long, env = "STANDBY_SERVER_AUTO_STOP", default_value_t = 15, value_name = "MINUTES")]
    auto_stop: u32,
    /// The local provider's sweeper: archive a sandbox stopped this long
    /// (`0`: never).
    #[arg(long, env = "STANDBY_SERVER_AUTO_ARCHIVE", default_value_t = 60, value_name = "MINUTES")]
    auto_archive: u32,
    /// The local provider's sweeper: delete a sandbox stopped this long
    /// (`0`: never).
    #[arg(long, env = "STANDBY_SERVER_AUTO_DELETE", default_value_t = 1440, value_name = "MINUTES")]
    auto_delete: u32,
    /// How long a provider minute is (auto-stop, archive, delete). Only
    /// tests shorten it.
    #[arg(long, env = "STANDBY_SERVER_PROVIDER_MINUTE", default_value = "60s", value_parser = parse_duration, value_name = "DURATION")]
    provider_minute: Duration,
    /// How long a resumed sandbox's agent may take to be ready before the
    /// run gets a fresh sandbox instead.
    #[arg(long, env = "STANDBY_SERVER_RESUME_TIMEOUT", default_value = "60s", value_parser = parse_duration, value_name = "DURATION")]
    resume_timeout: Duration,
}

impl PoolPolicyArgs {
    fn pool_policy(&self) -> PoolPolicy {
        PoolPolicy {
            running_cap: self.running_cap,
            standby_ttl: self.standby_ttl,
            warm_idle: self.warm_idle,
            park_stopped: self.park_stopped,
            auto_stop: AutoStop { minutes: self.auto_stop, minute: self.provider_minute },
            resume_timeout: self.resume_timeout,
        }
    }

    fn local_options(&self, stop_grace: Duration, containment: ContainmentChoice) -> LocalOptions {
        LocalOptions {
            minute: self.provider_minute,
            auto_archive: self.auto_archive,
            auto_delete: self.auto_delete,
            stop_grace,
            containment,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ProviderKind {
    Local,
    Docker,
    Spool,
}

#[derive(Debug, clap::Args)]
struct DemoArgs {
    /// The `standby` agent binary; `standby` next to this executable when unset.
    #[arg(long, env = "STANDBY_SERVER_AGENT_BIN", value_name = "PATH")]
    agent_bin: Option<PathBuf>,
    /// Bound on each wait (standbys ready, runs finished).
    #[arg(long, default_value = "3m", value_parser = parse_duration, value_name = "DURATION")]
    timeout: Duration,
    /// Follow-up turns of threads instead: on a running kept sandbox (Tier
    /// 2), a stopped one (Tier 1) and none (cold), with the median
    /// submit-to-start time of each.
    #[arg(long)]
    threads: bool,
    /// Added to the sample's setup step, standing in for a dependency
    /// install (what a cold sandbox pays and a kept one skips).
    #[arg(long, default_value = "0s", value_parser = parse_duration, value_name = "DURATION")]
    setup_cost: Duration,
    /// Rounds of follow-up turns with `--threads`.
    #[arg(long, default_value_t = 5, value_name = "N", requires = "threads")]
    rounds: usize,
    /// Where the sandboxes are made: `local` (directories and processes on
    /// this machine) or `docker` (containers of the Docker Engine: the image
    /// is built when missing, and the demo shows warm, cold, Tier 2 and
    /// Tier 1 on containers; needs root the first time, for debootstrap).
    #[arg(long, default_value = "local", value_name = "KIND")]
    provider: DemoProvider,
    /// `--provider docker`: the sandbox image, built by scripts/build-image
    /// when the engine does not have it.
    #[arg(long, default_value = "standby-sandbox:latest", value_name = "IMAGE")]
    image: String,
    /// `--provider docker`: the containers' network, created when missing
    /// (and then removed at the end).
    #[arg(long, default_value = "standby-demo", value_name = "NAME")]
    docker_network: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum DemoProvider {
    Local,
    Docker,
}

/// A byte count: a whole number, optionally followed by `KiB`, `MiB` or `GiB`.
fn parse_bytes(text: &str) -> Result<u64, String> {
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
        .ok_or_else(|| format!("`{text}` is not a byte count such as 1000, 512KiB or 64MiB"))
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim())
        .map_err(|e| format!("`{text}` is not a duration such as 500ms, 15s or 2m ({e})"))
}

fn agent_bin(given: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(path) = given {
        return Ok(path);
    }
    let exe = std::env::current_exe().context("cannot find this executable's path")?;
    Ok(exe.with_file_name("standby"))
}

/// The user API key, from its file or as given; never empty. A key file
/// that every local user can read is refused (the key is the whole user
/// API); one its group can read is taken with a warning, as a mounted
/// Kubernetes Secret with an `fsGroup` is.
fn api_key(file: Option<&Path>, given: Option<String>) -> anyhow::Result<Secret> {
    let key = match (file, given) {
        (Some(path), _) => {
            let read = || format!("cannot read the API key file {} (--api-key-file)", path.display());
            let mode = std::fs::metadata(path).with_context(read)?.permissions().mode() & 0o777;
            if mode & 0o007 != 0 {
                anyhow::bail!(
                    "the API key file {} is readable by every user (mode {mode:o}): chmod 600 it (or 640 for its group)",
                    path.display()
                );
            }
            if mode & 0o070 != 0 {
                tracing::warn!(path = %path.display(), mode = format!("{mode:o}"), "the API key file is readable by its group");
            }
            std::fs::read_to_string(path).with_context(read)?.trim().to_owned()
        }
        (None, Some(key)) => key.trim().to_owned(),
        (None, None) => anyhow::bail!(
            "the user API needs a key: --api-key-file <FILE> (STANDBY_SERVER_API_KEY_FILE) or STANDBY_SERVER_API_KEY"
        ),
    };
    if key.is_empty() {
        match file {
            Some(path) => anyhow::bail!("the API key file {} is empty", path.display()),
            None => anyhow::bail!("--api-key (STANDBY_SERVER_API_KEY) is empty"),
        }
    }
    Ok(Secret::new(key))
}

/// Makes the data directory (the store, the secret key, the sandboxes)
/// reachable by its owner only: created 0700, or tightened to it.
fn private_dir(dir: &Path) -> anyhow::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("cannot create the data directory {}", dir.display()))?;
    let mode = std::fs::metadata(dir)
        .with_context(|| format!("cannot read the data directory {}", dir.display()))?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("cannot make the data directory {} owner-only (0700)", dir.display()))?;
        tracing::info!(dir = %dir.display(), was = format!("{:o}", mode & 0o777), "the data directory is now 0700");
    }
    Ok(())
}

/// Dependencies that print frames, headers or SQL parameters at `debug`
/// and `trace`: assignment frames carry run credentials, requests carry
/// bearer tokens, and `tokio_postgres` prints every statement's parameters
/// (run records with their env and command, log bytes, credential hashes:
/// user data). They stay at `info` whatever the filter says.
const CAPPED_DEPENDENCIES: &[&str] = &[
    "tungstenite",
    "tokio_tungstenite",
    "hyper",
    "hyper_util",
    "reqwest",
    "h2",
    "rustls",
    "axum",
    "tower_http",
    "tokio_postgres",
    "postgres_protocol",
    "deadpool",
    "deadpool_postgres",
];

/// The caps are a filter of their own that every line must also pass, not
/// directives added to the user's: an `EnvFilter` lets the most specific
/// directive win, so `tokio_postgres::query=debug` would beat a
/// `tokio_postgres=info` cap.
fn init_logging(filter: Option<&str>) {
    use tracing_subscriber::filter::{FilterExt as _, LevelFilter, Targets};
    use tracing_subscriber::layer::{Layer as _, SubscriberExt as _};
    use tracing_subscriber::util::SubscriberInitExt as _;
    let filter =
        filter.map(str::to_owned).or_else(|| std::env::var("RUST_LOG").ok()).unwrap_or_else(|| "info".to_owned());
    let user = tracing_subscriber::EnvFilter::try_new(&filter).unwrap_or_else(|_| "info".into());
    let caps = Targets::new()
        .with_default(LevelFilter::TRACE)
        .with_targets(CAPPED_DEPENDENCIES.iter().map(|target| (*target, LevelFilter::INFO)));
    let layer = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_filter(user.and(caps));
    tracing_subscriber::registry().with(layer).init();
}

async fn serve(args: Serve) -> anyhow::Result<Ending> {
    let spec = match &args.spec {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read the spec file {}", path.display()))?;
            serde_json::from_str(&text).map_err(|e| {
                anyhow::anyhow!(
                    "the spec file {} is not a valid spec: {}",
                    path.display(),
                    standby_protocol::describe_json_error(&e)
                )
            })?
        }
        None => Spec::default(),
    };
    let api_key = api_key(args.api_key_file.as_deref(), args.api_key)?;
    let agent = match args.provider {
        ProviderKind::Local => {
            let agent = agent_bin(args.agent_bin)?;
            if !agent.is_file() {
                anyhow::bail!(
                    "the agent binary {} does not exist: build it (`cargo build --bins`) or pass --agent-bin",
                    agent.display()
                );
            }
            Some(agent)
        }
        ProviderKind::Spool | ProviderKind::Docker => None,
    };
    if args.provider == ProviderKind::Docker && args.listen.ip().is_loopback() {
        anyhow::bail!(
            "--provider docker: containers cannot reach the loopback address {}; listen on the gateway address of \
             --docker-network `{}` or on 0.0.0.0 (--listen 0.0.0.0:{})",
            args.listen,
            args.docker.docker_network,
            args.listen.port()
        );
    }
    private_dir(&args.data_dir)?;
    let key_path = args.secret_key_file.unwrap_or_else(|| args.data_dir.join("secret.key"));
    let location = StoreLocation::from_arg(args.store, &args.data_dir);
    // A replica's flags and secret are checked before the database is touched.
    let cluster = matches!(location, StoreLocation::Postgres(_)).then(|| args.replica.cluster()).transpose()?;
    // Replicas must share one key: theirs is made beforehand, never here.
    let key = if matches!(location, StoreLocation::Postgres(_)) {
        SealKey::load(&key_path)?
    } else {
        let (key, generated) = SealKey::load_or_generate(&key_path)?;
        if generated {
            tracing::info!(path = %key_path.display(), "generated the secret key that seals run requests at rest");
        }
        key
    };
    tracing::info!(store = location.describe(), "opening the store");
    let store = tokio::task::spawn_blocking(move || location.open_replicated(&key))
        .await
        .context("opening the store panicked")?
        .map_err(|error| match error {
            StoreError::SealKeyMismatch { .. } => {
                anyhow::Error::new(error).context(format!("the secret key file {}", key_path.display()))
            }
            other => other.into(),
        })?;
    let mut config = ServerConfig::new(api_key, spec);
    config.listen = args.listen;
    config.public_url = args.public_url;
    config.pool_size = args.pool_size;
    config.heartbeat_interval = args.heartbeat_interval;
    config.max_attempts = args.max_attempts.max(1);
    config.launch_timeout = args.launch_timeout;
    config.run_silence = args.run_lost_after;
    config.linger = args.linger;
    config.stop_grace = args.stop_grace;
    config.agent_log = args.agent_log;
    config.inject_latency = args.inject_latency;
    if args.pool_policy.running_cap != 0 && args.pool_policy.running_cap < args.pool_size {
        anyhow::bail!(
            "--running-cap {} cannot hold --pool-size {} standbys: raise the cap (or 0 for none)",
            args.pool_policy.running_cap,
            args.pool_size
        );
    }
    if args.pool_policy.provider_minute.is_zero() {
        anyhow::bail!("--provider-minute must be longer than zero");
    }
    config.pool_policy = args.pool_policy.pool_policy();
    config.bounds = RunBounds {
        log_cap: args.bounds.log_cap,
        retention: args.bounds.run_retention,
        idempotency_window: args.bounds.idempotency_window,
    };
    config.listener = args.limits.limits()?;
    let local_options = args.pool_policy.local_options(args.stop_grace, args.sandbox_containment);
    if args.provider == ProviderKind::Docker {
        let options = DockerOptions {
            image: args.docker.image,
            network: args.docker.docker_network,
            instance: instance_id(&args.data_dir)?,
            limits: Limits {
                cpus: args.docker.sandbox_cpus,
                memory: args.docker.sandbox_memory,
                pids: args.docker.sandbox_pids,
            },
            log_dir: args.data_dir.join("sandbox-logs"),
            minute: args.pool_policy.provider_minute,
            auto_archive: args.pool_policy.auto_archive,
            auto_delete: args.pool_policy.auto_delete,
            stop_grace: args.stop_grace,
        };
        let provider = DockerProvider::connect(options).await.context("--provider docker")?;
        return run_server(config, store, cluster, Arc::new(provider)).await;
    }
    match agent {
        Some(agent) => {
            let sandboxes = std::path::absolute(args.data_dir.join("sandboxes"))
                .with_context(|| format!("cannot resolve {}", args.data_dir.display()))?;
            let provider = LocalProvider::try_with_options(sandboxes, agent, local_options)
                .context("--sandbox-containment cannot be honoured")?;
            run_server(config, store, cluster, Arc::new(provider)).await
        }
        None => {
            let dir = args.spool_dir.unwrap_or_else(|| args.data_dir.join("spool"));
            let dir = std::path::absolute(&dir).with_context(|| format!("cannot resolve {}", dir.display()))?;
            let provider = if store.lease.is_some() { SpoolProvider::shared(dir) } else { SpoolProvider::new(dir) };
            run_server(config, store, cluster, Arc::new(provider)).await
        }
    }
}

/// This server's instance id, kept in `<data dir>/instance-id` (made on
/// first start): the label of its containers, so that a restart on the same
/// data finds them and another server's are never touched.
fn instance_id(data_dir: &Path) -> anyhow::Result<String> {
    let path = data_dir.join("instance-id");
    if let Ok(text) = std::fs::read_to_string(&path)
        && !text.trim().is_empty()
    {
        return Ok(text.trim().to_owned());
    }
    let id = format!("{:016x}", rand::random::<u64>());
    std::fs::write(&path, &id).with_context(|| format!("cannot write the instance id to {}", path.display()))?;
    Ok(id)
}

/// Serves until SIGTERM, SIGINT, a failure or a deposition: how it
/// ended. A signal or a failure shuts down in order; a deposed replica
/// exits at once: it may no longer tell or stop anything, and its
/// supervisor restarts it as a follower. A PostgreSQL store (with a
/// lease) makes it a replica, with `cluster` (checked with the flags).
async fn run_server<P: SandboxProvider>(
    config: ServerConfig,
    store: Opened,
    cluster: Option<ClusterConfig>,
    provider: Arc<P>,
) -> anyhow::Result<Ending> {
    let mut running = match (store.lease, cluster) {
        (Some(lease), Some(cluster)) => {
            server::start_replica(config, store.store, Replica { cluster, lease }, provider).await?
        }
        (None, None) => server::start(config, store.store, provider).await?,
        (Some(_), None) => anyhow::bail!("a shared store needs this replica's flags (--cluster-secret-file …)"),
        (None, Some(_)) => anyhow::bail!("replica flags were given for a store that is one server's"),
    };
    // One line on stdout once the listener is up: scripts (and the tests)
    // learn the URL from it when they asked for port 0.
    let mut stdout = std::io::stdout();
    writeln!(stdout, "standby-server listening on {}", running.url()).context("cannot write to stdout")?;
    stdout.flush().context("cannot write to stdout")?;
    let mut terminate = signal(SignalKind::terminate()).context("cannot install the SIGTERM handler")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("cannot install the SIGINT handler")?;
    let ending = tokio::select! {
        _ = terminate.recv() => Ending::Signal("SIGTERM"),
        _ = interrupt.recv() => Ending::Signal("SIGINT"),
        ending = running.ended() => ending,
    };
    match &ending {
        Ending::Deposed(_) => {}
        Ending::Signal(_) => running.shutdown().await?,
        Ending::Failed(_) => {
            // The failure is what is reported; the shutdown's own error
            // repeats it.
            let _ = running.shutdown().await;
        }
    }
    Ok(ending)
}

/// `standby-server keygen FILE`: the one key replicas share.
fn keygen(path: &Path) -> anyhow::Result<()> {
    SealKey::generate(path)?;
    tracing::info!(path = %path.display(), "wrote a new secret key: give every replica this file (--secret-key-file)");
    Ok(())
}

/// `standby-server migrate`: applies what the PostgreSQL store's schema
/// lacks, under the owner role; it seals and opens nothing, so it needs no
/// key.
async fn migrate(args: MigrateArgs) -> anyhow::Result<()> {
    let location = StoreLocation::from_arg(Some(args.store), Path::new("."));
    let StoreLocation::Postgres(url) = location else {
        anyhow::bail!("--store must be a postgres:// URL: a SQLite file is brought up to date when `serve` opens it");
    };
    let name = StoreLocation::Postgres(url.clone()).describe();
    tokio::task::spawn_blocking(move || PostgresStore::migrate_schema(&url))
        .await
        .context("migrating the store panicked")??;
    let mut stdout = std::io::stdout();
    writeln!(stdout, "standby-server: the schema of {name} is up to date").context("cannot write to stdout")?;
    Ok(())
}

async fn run_demo(args: DemoArgs) -> anyhow::Result<()> {
    let sandboxes = match args.provider {
        DemoProvider::Local => Sandboxes::Local,
        DemoProvider::Docker if args.threads => {
            anyhow::bail!("--threads is for the local provider: `demo --provider docker` shows every path")
        }
        DemoProvider::Docker => Sandboxes::Docker { image: args.image, network: args.docker_network },
    };
    let options = DemoOptions {
        agent_bin: agent_bin(args.agent_bin)?,
        pool_size: 2,
        timeout: args.timeout,
        setup_cost: args.setup_cost,
        sandboxes,
    };
    let mut stdout = std::io::stdout();
    if args.threads {
        demo::run_threads(&options, args.rounds.max(1), &mut stdout).await?;
    } else {
        demo::run(&options, &mut stdout).await?;
    }
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let demo = matches!(cli.command, Command::Demo(_));
    // The demo prints its own progress; its log shows only problems.
    init_logging(cli.log_filter.as_deref().or(demo.then_some("warn")));
    let result = match cli.command {
        // Stopped by a signal it succeeded; else how it ended is the error.
        Command::Serve(args) => serve(*args).await.and_then(|ending| match ending {
            Ending::Signal(_) => Ok(()),
            ending => Err(ending.into()),
        }),
        Command::Migrate(args) => migrate(args).await,
        Command::Demo(args) => run_demo(args).await,
        Command::Keygen { path } => keygen(&path),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!("{error:#}");
            eprintln!("standby-server: {error:#}");
            error.downcast_ref::<Ending>().map_or(ExitCode::FAILURE, |ending| ExitCode::from(ending.exit_code()))
        }
    }
}
