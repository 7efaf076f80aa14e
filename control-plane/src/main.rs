//! `standby-server`: the reference control plane (`serve`), the demo
//! (`demo`) and the tools around them (`config`, `migrate`, `keygen`,
//! `prune`). Thin: parses flags, sets up logging, calls the library; the
//! demo is the binary's own module, a client of the library.

mod demo;
mod prune;

use std::ffi::OsString;
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::parser::ValueSource;
use clap::{CommandFactory as _, FromArgMatches as _, Parser, Subcommand};
use demo::{DemoOptions, Sandboxes};
use standby_control_plane::cluster::ClusterConfig;
use standby_control_plane::config::flags::{Serve, parse_duration};
use standby_control_plane::config::{self, Config, LOG_ENV, ProviderConfig, Settings};
use standby_control_plane::provider::SandboxProvider;
use standby_control_plane::provider::docker::DockerProvider;
use standby_control_plane::provider::kubernetes::KubernetesProvider;
use standby_control_plane::provider::local::LocalProvider;
use standby_control_plane::provider::spool::SpoolProvider;
use standby_control_plane::seal::SealKey;
use standby_control_plane::server::{self, Ending, Replica, ServerConfig};
use standby_control_plane::store::{Opened, PostgresStore, StoreError, StoreLocation};
use standby_control_plane::{data_dir, listener};
use tokio::signal::unix::{SignalKind, signal};

/// The reference control plane for `standby`: the server half of the
/// contract, a warm pool of standbys on a sandbox provider, and a demo.
#[derive(Debug, Parser)]
#[command(name = "standby-server", version, about, long_about)]
struct Cli {
    /// Log filter (tracing EnvFilter syntax); `RUST_LOG` is read when unset.
    #[arg(long = "log", global = true, env = LOG_ENV, value_name = "FILTER")]
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
    /// Print the configuration `serve` would start with, given the same
    /// flags, variables and --config file (flag > environment > file >
    /// default): every key of the file with its value and where it came
    /// from (flag, env, file:line, default), secrets masked. Then check it
    /// as `serve` does at start: exit 1 naming what it would refuse.
    Config(Box<Serve>),
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
    /// Remove what an old instance of the Docker provider left on the
    /// engine: every container labelled `standby.instance=ID` (running or
    /// not) and every image with that label (archived sandboxes), and with
    /// --network its network once no container is on it. `--list` shows
    /// the instances that have containers or images, to find old ones.
    /// Never the instance of a server running on --data-dir.
    #[command(after_help = prune::AFTER_HELP)]
    Prune(prune::PruneArgs),
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

/// Starts the server `settings` describe: validates them, makes the data
/// directory, the secret key and the store, then serves: how it ended.
async fn serve(settings: Settings) -> anyhow::Result<Ending> {
    // The listener's default connection cap is derived from the raised limit.
    listener::raise_open_files_limit();
    let config = Config::validate(&settings)?;
    private_dir(&config.data_dir)?;
    // Held until the process ends: `prune` sees a server runs here.
    let _running = data_dir::lock_for_serve(&config.data_dir, |path| {
        tracing::info!(lock = %path.display(), "a `standby-server prune` holds the data directory: waiting for it");
    })
    .with_context(|| format!("cannot lock the data directory {}", config.data_dir.display()))?;
    let key_path = config.secret_key_file.clone();
    // Replicas must share one key: theirs is made beforehand, never here.
    let key = if matches!(config.store, StoreLocation::Postgres(_)) {
        SealKey::load(&key_path)?
    } else {
        let (key, generated) = SealKey::load_or_generate(&key_path)?;
        if generated {
            tracing::info!(path = %key_path.display(), "generated the secret key that seals run requests at rest");
        }
        key
    };
    let location = config.store.clone();
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
    match &config.provider {
        ProviderConfig::Docker(docker) => {
            let options = config.docker_options(docker, instance_id(&config.data_dir)?);
            let provider = DockerProvider::connect(options).await.context("--provider docker")?;
            run_server(config.server, store, config.cluster, Arc::new(provider)).await
        }
        ProviderConfig::Kubernetes(kubernetes) => {
            let options = config.kubernetes_options(kubernetes, instance_id(&config.data_dir)?);
            let provider = KubernetesProvider::connect(options).await.context("--provider kubernetes")?;
            run_server(config.server, store, config.cluster, Arc::new(provider)).await
        }
        ProviderConfig::Local(local) => {
            let options = config.local_options(local);
            let provider = LocalProvider::try_with_options(local.sandboxes.clone(), local.agent.clone(), options)
                .context("--sandbox-containment cannot be honoured")?;
            run_server(config.server, store, config.cluster, Arc::new(provider)).await
        }
        ProviderConfig::Spool { dir } => {
            let dir = dir.clone();
            let provider = if store.lease.is_some() { SpoolProvider::shared(dir) } else { SpoolProvider::new(dir) };
            run_server(config.server, store, config.cluster, Arc::new(provider)).await
        }
    }
}

/// `standby-server config`: the merged settings on stdout, then the
/// refusals `serve` would make at start.
fn show_config(settings: &Settings) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout();
    stdout.write_all(settings.render().as_bytes()).context("cannot write to stdout")?;
    stdout.flush().context("cannot write to stdout")?;
    Config::validate(settings).context("`serve` would refuse this configuration")?;
    Ok(())
}

/// This server's instance id, kept in `<data dir>/instance-id` (made on
/// first start): the label of its containers, so that a restart on the same
/// data finds them and another server's are never touched.
fn instance_id(data_dir: &Path) -> anyhow::Result<String> {
    if let Some(id) = data_dir::instance_id(data_dir) {
        return Ok(id);
    }
    let path = data_dir.join(data_dir::INSTANCE_FILE);
    let id = format!("{:016x}", rand::random::<u64>());
    std::fs::write(&path, &id).with_context(|| format!("cannot write the instance id to {}", path.display()))?;
    Ok(id)
}

/// Serves until SIGTERM, SIGINT, a failure or a deposition: how it
/// ended. A signal or a failure shuts down in order; a deposed replica
/// exits at once: it may no longer tell or stop anything, and its
/// supervisor restarts it as a follower. A PostgreSQL store (with a
/// lease) makes it a replica, with `cluster` (validated with the rest).
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
        (Some(_), None) => anyhow::bail!("a shared store needs this replica's settings (--cluster-secret-file …)"),
        (None, Some(_)) => anyhow::bail!("replica settings were given for a store that is one server's"),
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
        agent_bin: config::agent_bin(args.agent_bin.as_deref())?,
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
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|error| error.exit());
    let log = (cli.log_filter, matches.value_source("log_filter"));
    let result = match cli.command {
        // Stopped by a signal it succeeded; else how it ended is the error.
        Command::Serve(args) => match merge(*args, log, &matches) {
            Ok(settings) => serve(settings).await.and_then(|ending| match ending {
                Ending::Signal(_) => Ok(()),
                ending => Err(ending.into()),
            }),
            Err(error) => Err(error),
        },
        Command::Config(args) => merge(*args, log, &matches).and_then(|settings| show_config(&settings)),
        Command::Migrate(args) => {
            init_logging(log.0.as_deref());
            migrate(args).await
        }
        Command::Demo(args) => {
            // The demo prints its own progress; its log shows only problems.
            init_logging(log.0.as_deref().or(Some("warn")));
            run_demo(args).await
        }
        Command::Keygen { path } => {
            init_logging(log.0.as_deref());
            keygen(&path)
        }
        Command::Prune(args) => {
            // Its progress is its own lines on stderr; the log shows only problems.
            init_logging(log.0.as_deref().or(Some("warn")));
            prune::run(args).await
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!("{error:#}");
            eprintln!("standby-server: {error:#}");
            if error.downcast_ref::<prune::Refused>().is_some() {
                return ExitCode::from(prune::REFUSED);
            }
            error.downcast_ref::<Ending>().map_or(ExitCode::FAILURE, |ending| ExitCode::from(ending.exit_code()))
        }
    }
}

/// `serve`'s and `config`'s settings: the flags with the file merged in;
/// logging starts once `--log` is known (the file may set it).
fn merge(
    args: Serve,
    log: (Option<String>, Option<ValueSource>),
    matches: &clap::ArgMatches,
) -> anyhow::Result<Settings> {
    let subcommand = matches.subcommand().map(|(_, matches)| matches).context("no subcommand")?;
    let merged = Settings::merge(args, log, subcommand);
    init_logging(merged.as_ref().ok().and_then(|settings| settings.log.as_deref()));
    Ok(merged?)
}
