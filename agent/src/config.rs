//! Configuration: command-line flags with the contract's environment
//! variables as fallbacks. Everything is validated here, before any IO, so a
//! bad setting exits 2 with a message naming the setting and the value.

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use clap::{Parser, ValueEnum};
use reqwest::Url;
use standby_protocol::{ExitCode, Secret, vars};

use crate::time::Deadline;
use crate::urls::is_loopback;

/// `standby`: the pre-warmed sandbox agent.
///
/// Launched as a sandbox image's entrypoint, it prepares the workspace
/// (clones, setup commands, MCP servers, an idle shell) before any run
/// exists, holds a control WebSocket to the server with heartbeats, and when
/// an assignment arrives installs the run credential, installs the run in
/// parallel groups, confirms delivery and starts the run on the prepared
/// terminal. A failure before the run starts is reported as requeueable so
/// the server can dispatch the run on a cold sandbox instead.
/// What `standby --version` prints after the name: the version and the
/// commit it was built from (`agent/build.rs`).
pub const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("STANDBY_COMMIT"), ")");

#[derive(Debug, Parser)]
#[command(name = "standby", version = VERSION, about, long_about, after_help = ExitCode::help_text())]
pub struct Args {
    /// Base URL of the server, `http(s)://host:port[/prefix]`. The control
    /// socket is the same URL with `ws(s)` and `/ws` appended.
    #[arg(long, env = vars::SERVER_URL, value_name = "URL")]
    pub(crate) server_url: String,

    /// The standby credential identifying this sandbox. Never logged.
    /// Exactly one of this and --token-file.
    #[arg(long, env = vars::TOKEN, value_name = "TOKEN", hide_env_values = true,
          value_parser = parse_secret)]
    pub(crate) token: Option<Secret>,

    /// A file holding the standby credential (a mounted secret), read once
    /// at start; a trailing line break is trimmed. Exactly one of this and
    /// --token.
    #[arg(long, env = vars::TOKEN_FILE, value_name = "FILE")]
    pub(crate) token_file: Option<PathBuf>,

    /// Directory the workspace is prepared in.
    #[arg(long, env = vars::WORKSPACE, value_name = "DIR", default_value = "/workspace")]
    pub(crate) workspace: PathBuf,

    /// Path of a spec file (JSON). When unset the spec is fetched from
    /// `GET /v1/standby/spec`.
    #[arg(long, env = vars::SPEC, value_name = "FILE")]
    pub(crate) spec: Option<PathBuf>,

    /// How often a heartbeat is sent on the control socket (e.g. 250ms, 15s, 2m).
    #[arg(long, env = vars::HEARTBEAT_INTERVAL, value_name = "DURATION", default_value = "15s",
          value_parser = parse_duration)]
    pub(crate) heartbeat_interval: Duration,

    /// With no assignment by then, exit 12. An RFC 3339 time or a duration
    /// from start. The earlier of this and the spec's `deadline` applies.
    #[arg(long, env = vars::DEADLINE, value_name = "TIME|DURATION", value_parser = parse_deadline)]
    pub(crate) deadline: Option<Deadline>,

    /// How long delivery confirmation retries transient failures.
    #[arg(long, env = vars::CONFIRM_TIMEOUT, value_name = "DURATION", default_value = "5m",
          value_parser = parse_duration)]
    pub(crate) confirm_timeout: Duration,

    /// Bound on installing the run, retries included.
    #[arg(long, env = vars::INSTALL_TIMEOUT, value_name = "DURATION", default_value = "5m",
          value_parser = parse_duration)]
    pub(crate) install_timeout: Duration,

    /// Bound on the whole preparation (spec, clones, setup, MCP servers, idle
    /// shell). When it passes with no assignment held, exit 15; with one
    /// held, the install fails (stage `prepare`, requeueable) and exit 13.
    #[arg(long, env = vars::PREPARE_TIMEOUT, value_name = "DURATION", default_value = "30m",
          value_parser = parse_duration)]
    pub(crate) prepare_timeout: Duration,

    /// The snapshot this sandbox's filesystem was made from, set by a
    /// provider that makes sandboxes from a snapshot of a prepared one: a
    /// workspace prepared there is refreshed once (its clones moved to
    /// their refs' heads) instead of used as it is.
    #[arg(long, env = vars::SNAPSHOT, value_name = "ID")]
    pub(crate) snapshot: Option<String>,

    /// After a cancel or SIGTERM, how long the run has between SIGTERM and SIGKILL.
    #[arg(long, env = "STANDBY_CANCEL_GRACE", value_name = "DURATION", default_value = "10s",
          value_parser = parse_duration)]
    pub(crate) cancel_grace: Duration,

    /// How long each MCP server has to become ready.
    #[arg(long, env = "STANDBY_MCP_READY_TIMEOUT", value_name = "DURATION", default_value = "20s",
          value_parser = parse_duration)]
    pub(crate) mcp_ready_timeout: Duration,

    /// How long an event (started, exited, ...) is retried before it is given up.
    #[arg(long, env = "STANDBY_EVENT_TIMEOUT", value_name = "DURATION", default_value = "10m",
          value_parser = parse_duration)]
    pub(crate) event_timeout: Duration,

    /// Log filter in `tracing` EnvFilter syntax; `RUST_LOG` is read when unset.
    #[arg(long = "log", env = vars::LOG, value_name = "FILTER")]
    pub log_filter: Option<String>,

    /// Log line format: `text` for people, `json` for log collectors.
    #[arg(long, env = vars::LOG_FORMAT, value_name = "FORMAT", default_value = "text")]
    pub log_format: LogFormat,

    /// Allow plain `http://`/`ws://` to a host that is not a loopback address
    /// (the server, and attachments on another origin).
    #[arg(long, env = "STANDBY_INSECURE")]
    pub(crate) insecure: bool,

    /// Bytes of the run's output kept while the log endpoint fails (testing only).
    #[arg(long, env = "STANDBY_LOG_SPOOL_MAX", value_name = "BYTES", default_value_t = crate::logship::SPOOL_BOUND,
          value_parser = clap::value_parser!(u64).range(1..), hide = true)]
    pub(crate) log_spool_max: u64,
    /// A PEM file of extra CA certificates, trusted next to the system's
    /// roots for both the control socket (wss) and HTTP calls (https): a
    /// server or object store behind a private CA. Unreadable, or holding
    /// no certificate: exit 2.
    #[arg(long, env = "STANDBY_CA_FILE", value_name = "FILE")]
    pub(crate) ca_file: Option<PathBuf>,

    /// An OTLP/HTTP endpoint (`http(s)://collector:4318`; `/v1/traces` is
    /// appended unless the path ends with it): the install's spans are
    /// exported there, joined to the server's trace of the run. Unset:
    /// nothing is traced. Plain http is allowed anywhere: spans hold no
    /// credential.
    #[arg(long, env = vars::OTLP_ENDPOINT, value_name = "URL")]
    pub(crate) otlp_endpoint: Option<String>,

    /// Run the install steps one after another (benchmarking only).
    #[arg(long, env = "STANDBY_INSTALL_PLAN", value_name = "PLAN", default_value = "parallel", hide = true)]
    pub(crate) install_plan: InstallPlan,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum InstallPlan {
    Parallel,
    Sequential,
}

fn parse_secret(text: &str) -> Result<Secret, String> {
    if text.trim().is_empty() {
        return Err("the credential is empty".into());
    }
    Ok(Secret::new(text))
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim())
        .map_err(|e| format!("`{text}` is not a duration such as 250ms, 15s or 2m ({e})"))
}

fn parse_deadline(text: &str) -> Result<Deadline, String> {
    if let Ok(at) = parse_time(text) {
        return Ok(Deadline::At(at));
    }
    humantime::parse_duration(text.trim())
        .map(Deadline::After)
        .map_err(|_| format!("`{text}` is neither an RFC 3339 time (2026-11-30T14:00:00Z) nor a duration (90s)"))
}

/// Parses an RFC 3339 time, with `Z` or a numeric offset.
pub(crate) fn parse_time(text: &str) -> Result<SystemTime, String> {
    let timestamp: jiff::Timestamp =
        text.trim().parse().map_err(|e| format!("`{text}` is not an RFC 3339 time: {e}"))?;
    SystemTime::try_from(timestamp).map_err(|e| format!("`{text}` is out of range: {e}"))
}

/// Validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub server_url: Url,
    pub(crate) socket_url: Url,
    pub(crate) token: Secret,
    pub workspace: PathBuf,
    pub(crate) spec: Option<PathBuf>,
    pub(crate) heartbeat_interval: Duration,
    pub(crate) deadline: Option<Deadline>,
    pub(crate) confirm_timeout: Duration,
    pub(crate) install_timeout: Duration,
    pub(crate) prepare_timeout: Duration,
    /// `STANDBY_SNAPSHOT`; an empty value counts as unset.
    pub(crate) snapshot: Option<String>,
    pub(crate) cancel_grace: Duration,
    pub(crate) mcp_ready_timeout: Duration,
    pub(crate) event_timeout: Duration,
    pub(crate) install_plan: InstallPlan,
    pub(crate) log_spool_max: u64,
    /// Plain http allowed off loopback (`--insecure`).
    pub(crate) insecure: bool,
    /// Extra trusted CA certificates (`STANDBY_CA_FILE`), loaded by [`crate::tls`].
    pub ca_file: Option<PathBuf>,
    /// Where spans go (`STANDBY_OTLP_ENDPOINT`, as a traces URL); `None`:
    /// no exporter is made.
    pub(crate) otlp_traces_url: Option<Url>,
}

/// A setting that failed validation; the agent exits 2 with this message.
#[derive(Debug, thiserror::Error)]
#[error("invalid {setting}: {problem}")]
pub struct ConfigError {
    pub(crate) setting: &'static str,
    pub(crate) problem: String,
}

impl Args {
    pub fn validate(self) -> Result<Config, ConfigError> {
        let server_url = parse_server_url(&self.server_url, self.insecure)?;
        let token = match (self.token, &self.token_file) {
            (Some(token), None) => token,
            (None, Some(path)) => read_token_file(path)?,
            (token, _) => {
                let problem = if token.is_some() { "both are set" } else { "neither is set" };
                return Err(ConfigError { setting: TOKEN_SETTINGS, problem: format!("{problem}; set exactly one") });
            }
        };
        let socket_url = socket_url(&server_url);
        let otlp_traces_url =
            self.otlp_endpoint.as_deref().map(standby_otlp::traces_url).transpose().map_err(|e| ConfigError {
                setting: "STANDBY_OTLP_ENDPOINT (--otlp-endpoint)",
                problem: e.to_string(),
            })?;
        if self.heartbeat_interval.is_zero() {
            return Err(ConfigError {
                setting: "STANDBY_HEARTBEAT_INTERVAL (--heartbeat-interval)",
                problem: "`0s`: the interval must be positive".into(),
            });
        }
        Ok(Config {
            server_url,
            socket_url,
            token,
            workspace: self.workspace,
            spec: self.spec,
            heartbeat_interval: self.heartbeat_interval,
            deadline: self.deadline,
            confirm_timeout: self.confirm_timeout,
            install_timeout: self.install_timeout,
            prepare_timeout: self.prepare_timeout,
            snapshot: self.snapshot.filter(|id| !id.is_empty()),
            cancel_grace: self.cancel_grace,
            mcp_ready_timeout: self.mcp_ready_timeout,
            event_timeout: self.event_timeout,
            install_plan: self.install_plan,
            log_spool_max: self.log_spool_max,
            insecure: self.insecure,
            ca_file: self.ca_file,
            otlp_traces_url,
        })
    }
}

const URL_SETTING: &str = "STANDBY_SERVER_URL (--server-url)";
const TOKEN_SETTINGS: &str = "STANDBY_TOKEN (--token) / STANDBY_TOKEN_FILE (--token-file)";
const TOKEN_FILE_SETTING: &str = "STANDBY_TOKEN_FILE (--token-file)";
/// `STANDBY_TOKEN_FILE=/dev/stdin`: the credential comes on the standard input.
const STDIN_PATH: &str = "/dev/stdin";

/// The credential in `path`, without its trailing line breaks (`echo`
/// and editors add one; a mounted Kubernetes Secret has none).
fn read_token_file(path: &std::path::Path) -> Result<Secret, ConfigError> {
    let bad = |problem: String| ConfigError { setting: TOKEN_FILE_SETTING, problem };
    // `/dev/stdin` is read from descriptor 0 rather than opened: when the
    // stdin is a pipe made by another user (a container engine's exec, as
    // the Docker provider passes each fresh credential), opening its
    // `/proc/self/fd/0` link is refused, reading the descriptor is not.
    let read = if path == std::path::Path::new(STDIN_PATH) {
        std::io::read_to_string(std::io::stdin())
    } else {
        std::fs::read_to_string(path)
    };
    let text = read.map_err(|e| bad(format!("cannot read {}: {e}", path.display())))?;
    let token = text.trim_end_matches(['\n', '\r']);
    if token.trim().is_empty() {
        return Err(bad(format!("{} is empty", path.display())));
    }
    Ok(Secret::new(token))
}

fn parse_server_url(text: &str, insecure: bool) -> Result<Url, ConfigError> {
    let bad = |problem: String| ConfigError { setting: URL_SETTING, problem };
    let mut url = Url::parse(text.trim()).map_err(|e| bad(format!("`{text}` is not a URL: {e}")))?;
    let host = url.host_str().ok_or_else(|| bad(format!("`{text}` has no host")))?.to_owned();
    match url.scheme() {
        "https" => {}
        "http" if insecure || is_loopback(&host) => {}
        "http" => {
            return Err(bad(format!(
                "`{text}` is plain http to `{host}`, which is not a loopback address; use https or pass --insecure"
            )));
        }
        other => return Err(bad(format!("`{text}` has scheme `{other}`; expected http or https"))),
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(bad("the URL must not carry credentials; use STANDBY_TOKEN".into()));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(bad(format!("`{text}` has a query or fragment")));
    }
    // Paths are appended to the base, so keep it without a trailing slash.
    let trimmed = url.path().trim_end_matches('/').to_owned();
    url.set_path(&trimmed);
    Ok(url)
}

fn socket_url(server_url: &Url) -> Url {
    let mut url = server_url.clone();
    let scheme = if server_url.scheme() == "https" { "wss" } else { "ws" };
    // Switching between the special schemes http(s) and ws(s) is allowed.
    let _ = url.set_scheme(scheme);
    let path = format!("{}{}", server_url.path().trim_end_matches('/'), standby_protocol::SOCKET_PATH);
    url.set_path(&path);
    url
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> Result<Config, String> {
        let mut argv = vec!["standby", "--token", "t"];
        argv.extend_from_slice(extra);
        let args = Args::try_parse_from(argv).map_err(|e| e.to_string())?;
        args.validate().map_err(|e| e.to_string())
    }

    #[test]
    fn socket_url_keeps_prefix_and_switches_scheme() {
        let config = args(&["--server-url", "https://cp.example/base/"]).expect("valid");
        assert_eq!(config.socket_url.as_str(), "wss://cp.example/base/ws");
        let api = crate::api::Api::new(&config.server_url).expect("an HTTP client");
        assert_eq!(api.url(standby_protocol::SPEC_PATH), "https://cp.example/base/v1/standby/spec");
        let config = args(&["--server-url", "http://127.0.0.1:8080"]).expect("valid");
        assert_eq!(config.socket_url.as_str(), "ws://127.0.0.1:8080/ws");
    }

    /// No endpoint: no traces URL, so no exporter is ever made. One is a
    /// traces URL (plain http allowed anywhere: spans hold no credential);
    /// a bad one is refused naming the setting.
    #[test]
    fn the_otlp_endpoint_is_optional_and_checked() {
        let base = ["--server-url", "http://127.0.0.1:1"];
        assert_eq!(args(&base).expect("valid").otlp_traces_url, None);
        let config = args(&[&base[..], &["--otlp-endpoint", "http://10.0.0.9:4318"]].concat()).expect("valid");
        assert_eq!(config.otlp_traces_url.map(String::from).as_deref(), Some("http://10.0.0.9:4318/v1/traces"));
        let error = args(&[&base[..], &["--otlp-endpoint", "udp://c:4318"]].concat()).expect_err("refused");
        assert!(error.contains("STANDBY_OTLP_ENDPOINT") && error.contains("udp://c:4318"), "{error}");
    }

    #[test]
    fn plain_http_needs_loopback_or_insecure() {
        for ok in ["http://localhost:1", "http://127.0.0.2:1", "http://[::1]:1"] {
            args(&["--server-url", ok]).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        let error = args(&["--server-url", "http://10.1.2.3:80"]).expect_err("refused");
        assert!(error.contains("STANDBY_SERVER_URL") && error.contains("10.1.2.3"), "{error}");
        args(&["--server-url", "http://10.1.2.3:80", "--insecure"]).expect("allowed with --insecure");
    }

    #[test]
    fn bad_values_name_setting_and_value() {
        let error = args(&["--server-url", "http://127.0.0.1:1", "--heartbeat-interval", "abc"]).expect_err("refused");
        assert!(error.contains("--heartbeat-interval") && error.contains("abc"), "{error}");
        let error = args(&["--server-url", "ftp://x"]).expect_err("refused");
        assert!(error.contains("ftp"), "{error}");
    }

    #[test]
    fn deadline_accepts_times_and_durations() {
        assert!(matches!(parse_deadline("2026-11-30T14:00:00Z"), Ok(Deadline::At(_))));
        assert!(matches!(parse_deadline("2026-11-30T15:00:00+01:00"), Ok(Deadline::At(_))));
        assert_eq!(parse_deadline("90s"), Ok(Deadline::After(Duration::from_secs(90))));
        assert!(parse_deadline("tomorrow").is_err());
    }

    #[test]
    fn exactly_one_of_token_and_token_file() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let file = dir.path().join("token");
        std::fs::write(&file, "from-file\r\n").expect("write");
        let path = file.to_str().expect("UTF-8");
        let url = ["--server-url", "http://127.0.0.1:1"];
        let parse = |extra: &[&str]| {
            let argv = ["standby"].iter().chain(url.iter()).chain(extra).copied().collect::<Vec<_>>();
            Args::try_parse_from(argv).expect("parses").validate()
        };
        let config = parse(&["--token-file", path]).expect("valid");
        assert_eq!(config.token.expose(), "from-file", "the line break is trimmed");
        for (extra, problem) in [(&["--token", "t", "--token-file", path][..], "both"), (&[][..], "neither")] {
            let error = parse(extra).expect_err("refused").to_string();
            assert!(
                error.contains("STANDBY_TOKEN ") && error.contains("STANDBY_TOKEN_FILE") && error.contains(problem)
            );
        }
        std::fs::write(&file, "\n").expect("write");
        let error = parse(&["--token-file", path]).expect_err("empty").to_string();
        assert!(error.contains(path) && error.contains("empty"), "{error}");
        let missing = dir.path().join("missing");
        let error = parse(&["--token-file", missing.to_str().expect("UTF-8")]).expect_err("missing").to_string();
        assert!(error.contains("STANDBY_TOKEN_FILE") && error.contains("missing"), "{error}");
    }

    #[test]
    fn token_is_hidden_from_debug() {
        let parsed =
            Args::try_parse_from(["standby", "--token", "tok3n", "--server-url", "http://127.0.0.1:1"]).expect("valid");
        assert!(!format!("{parsed:?}").contains("tok3n"));
        let config = parsed.validate().expect("valid");
        assert!(!format!("{config:?}").contains("tok3n"));
    }
}
