//! `standby-server`: the reference control plane (`serve`) and the demo
//! (`demo`). Thin: parses flags, sets up logging, calls the library.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use standby_control_plane::demo::{self, DemoOptions};
use standby_control_plane::provider::LocalProvider;
use standby_control_plane::server::{self, ServerConfig};
use standby_control_plane::store::SqliteStore;
use standby_protocol::{Secret, Spec, Workspace};
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
    Serve(Box<Serve>),
    /// Show the whole system on this machine: a sample repository, two
    /// standbys, three runs (warm and cold), a table of what each took.
    Demo(DemoArgs),
}

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
    /// The SQLite store file; `<data dir>/standby.db` when unset.
    #[arg(long, env = "STANDBY_SERVER_STORE", value_name = "PATH")]
    store: Option<PathBuf>,
    /// Standbys kept ready.
    #[arg(long, env = "STANDBY_SERVER_POOL_SIZE", default_value_t = 2, value_name = "N")]
    pool_size: usize,
    /// The standby spec (JSON, the shape of `GET /v1/standby/spec`); an
    /// empty workspace when unset.
    #[arg(long, env = "STANDBY_SERVER_SPEC", value_name = "FILE")]
    spec: Option<PathBuf>,
    /// The key of the user API (`Authorization: Bearer <key>`). Never logged.
    #[arg(long, env = "STANDBY_SERVER_API_KEY", hide_env_values = true, value_name = "KEY")]
    api_key: String,
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
    /// How long a finished, cancelled or retired sandbox may take to exit by itself.
    #[arg(long, env = "STANDBY_SERVER_LINGER", default_value = "30s", value_parser = parse_duration, value_name = "DURATION")]
    linger: Duration,
    /// Between SIGTERM and SIGKILL when stopping a sandbox.
    #[arg(long, env = "STANDBY_SERVER_STOP_GRACE", default_value = "10s", value_parser = parse_duration, value_name = "DURATION")]
    stop_grace: Duration,
    /// `STANDBY_LOG` of the agents (their output goes to `<sandbox>/agent.log`).
    #[arg(long, env = "STANDBY_SERVER_AGENT_LOG", default_value = "info", value_name = "FILTER")]
    agent_log: String,
}

#[derive(Debug, clap::Args)]
struct DemoArgs {
    /// The `standby` agent binary; `standby` next to this executable when unset.
    #[arg(long, env = "STANDBY_SERVER_AGENT_BIN", value_name = "PATH")]
    agent_bin: Option<PathBuf>,
    /// Bound on each wait (standbys ready, runs finished).
    #[arg(long, default_value = "3m", value_parser = parse_duration, value_name = "DURATION")]
    timeout: Duration,
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

fn init_logging(filter: Option<&str>) {
    let filter =
        filter.map(str::to_owned).or_else(|| std::env::var("RUST_LOG").ok()).unwrap_or_else(|| "info".to_owned());
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&filter).unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
}

async fn serve(args: Serve) -> anyhow::Result<()> {
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
        None => Spec { workspace: Workspace::default(), mcp_servers: Vec::new(), shell: None, deadline: None },
    };
    if args.api_key.trim().is_empty() {
        anyhow::bail!("--api-key (STANDBY_SERVER_API_KEY) is empty");
    }
    let agent = agent_bin(args.agent_bin)?;
    if !agent.is_file() {
        anyhow::bail!(
            "the agent binary {} does not exist: build it (`cargo build --bins`) or pass --agent-bin",
            agent.display()
        );
    }
    let store_path = args.store.unwrap_or_else(|| args.data_dir.join("standby.db"));
    let store = Arc::new(SqliteStore::open(&store_path)?);
    let sandboxes = std::path::absolute(args.data_dir.join("sandboxes"))
        .with_context(|| format!("cannot resolve {}", args.data_dir.display()))?;
    let provider = Arc::new(LocalProvider::new(sandboxes, agent));
    let mut config = ServerConfig::new(Secret::new(args.api_key), spec);
    config.listen = args.listen;
    config.public_url = args.public_url;
    config.pool_size = args.pool_size;
    config.heartbeat_interval = args.heartbeat_interval;
    config.max_attempts = args.max_attempts.max(1);
    config.launch_timeout = args.launch_timeout;
    config.linger = args.linger;
    config.stop_grace = args.stop_grace;
    config.agent_log = args.agent_log;
    let mut running = server::start(config, store, provider).await?;
    // One line on stdout once the listener is up: scripts (and the tests)
    // learn the URL from it when they asked for port 0.
    let mut stdout = std::io::stdout();
    writeln!(stdout, "standby-server listening on {}", running.url()).context("cannot write to stdout")?;
    stdout.flush().context("cannot write to stdout")?;
    let mut terminate = signal(SignalKind::terminate()).context("cannot install the SIGTERM handler")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("cannot install the SIGINT handler")?;
    let failure = tokio::select! {
        _ = terminate.recv() => None,
        _ = interrupt.recv() => None,
        message = running.failed() => Some(message),
    };
    let stopped = running.shutdown().await;
    if let Some(message) = failure {
        anyhow::bail!("the server failed: {message}");
    }
    stopped?;
    Ok(())
}

async fn run_demo(args: DemoArgs) -> anyhow::Result<()> {
    let options = DemoOptions { agent_bin: agent_bin(args.agent_bin)?, pool_size: 2, timeout: args.timeout };
    let mut stdout = std::io::stdout();
    demo::run(&options, &mut stdout).await?;
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let demo = matches!(cli.command, Command::Demo(_));
    // The demo prints its own progress; its log shows only problems.
    init_logging(cli.log_filter.as_deref().or(demo.then_some("warn")));
    let result = match cli.command {
        Command::Serve(args) => serve(*args).await,
        Command::Demo(args) => run_demo(args).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!("{error:#}");
            eprintln!("standby-server: {error:#}");
            ExitCode::FAILURE
        }
    }
}
