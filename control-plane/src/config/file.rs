//! The configuration file: TOML, one table per group of flags, every key
//! a flag's name without `--` in snake case. Each value keeps its span, so
//! that `standby-server config` can say which line it came from, and an
//! unknown key or a wrong type is refused with its line.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use standby_protocol::Secret;
use toml::Spanned;

use super::ConfigError;
use super::flags::{Bytes, ProviderKind, StoreArg, parse_bytes, parse_duration};
use crate::containment::ContainmentChoice;
use crate::provider::docker::{Allow, Egress, OnStop};
use crate::provider::kubernetes::KubernetesApi;

/// Keys whose value is a secret (or holds one): an error never quotes it.
const SECRET_KEYS: &[&str] = &["api_key", "store"];

/// A key's value and where it is in the file.
pub type Value<T> = Option<Spanned<T>>;

/// The whole file. Its top level holds the keys of no group.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub log: Value<String>,
    pub listen: Value<SocketAddr>,
    pub public_url: Value<String>,
    pub data_dir: Value<PathBuf>,
    pub store: Value<StoreText>,
    pub spec: Value<PathBuf>,
    pub api_key_file: Value<PathBuf>,
    pub api_key: Value<Secret>,
    pub secret_key_file: Value<PathBuf>,
    pub provider: Value<Choice<ProviderKind>>,
    pub inject_latency: Value<HumanDuration>,
    #[serde(default)]
    pub sandbox: SandboxTable,
    #[serde(default)]
    pub pool: PoolTable,
    #[serde(default)]
    pub local: LocalTable,
    #[serde(default)]
    pub docker: DockerTable,
    #[serde(default)]
    pub kubernetes: KubernetesTable,
    #[serde(default)]
    pub spool: SpoolTable,
    #[serde(default)]
    pub bounds: BoundsTable,
    #[serde(default)]
    pub listener: ListenerTable,
    #[serde(default)]
    pub replica: ReplicaTable,
    #[serde(default)]
    pub telemetry: TelemetryTable,
}

/// `[sandbox]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxTable {
    pub heartbeat_interval: Value<HumanDuration>,
    pub max_attempts: Value<u32>,
    pub launch_timeout: Value<HumanDuration>,
    pub run_lost_after: Value<HumanDuration>,
    pub linger: Value<HumanDuration>,
    pub stop_grace: Value<HumanDuration>,
    pub agent_log: Value<String>,
}

/// `[pool]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolTable {
    pub pool_size: Value<usize>,
    pub running_cap: Value<usize>,
    pub max_preparing: Value<usize>,
    pub standby_ttl: Value<HumanDuration>,
    pub warm_idle: Value<HumanDuration>,
    pub park_stopped: Value<bool>,
    pub auto_stop: Value<u32>,
    pub auto_archive: Value<u32>,
    pub auto_delete: Value<u32>,
    pub provider_minute: Value<HumanDuration>,
    pub resume_timeout: Value<HumanDuration>,
}

/// `[local]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalTable {
    pub agent_bin: Value<PathBuf>,
    pub sandbox_containment: Value<Choice<ContainmentChoice>>,
}

/// `[docker]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DockerTable {
    pub image: Value<String>,
    pub docker_network: Value<String>,
    pub sandbox_cpus: Value<f64>,
    pub sandbox_memory: Value<ByteCount>,
    pub sandbox_pids: Value<u64>,
    pub on_stop: Value<Choice<OnStop>>,
    pub sandbox_egress: Value<Choice<Egress>>,
    pub sandbox_egress_allow: Value<AllowList>,
    pub sandbox_runtime: Value<String>,
    pub snapshot_keep: Value<usize>,
    pub snapshot_max_age: Value<HumanDuration>,
}

/// `[kubernetes]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesTable {
    pub kubernetes_namespace: Value<String>,
    pub kubernetes_pod_template: Value<PathBuf>,
    pub kubernetes_workspace_size: Value<String>,
    pub kubernetes_storage_class: Value<String>,
    pub kubernetes_instance: Value<String>,
    pub kubernetes_api: Value<Choice<KubernetesApi>>,
    pub kubernetes_warm_pool: Value<u32>,
}

/// `[spool]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpoolTable {
    pub spool_dir: Value<PathBuf>,
}

/// `[bounds]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BoundsTable {
    pub log_cap: Value<ByteCount>,
    pub run_retention: Value<HumanDuration>,
    pub idempotency_window: Value<HumanDuration>,
}

/// `[listener]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerTable {
    pub header_timeout: Value<HumanDuration>,
    pub body_timeout: Value<HumanDuration>,
    pub max_connections: Value<usize>,
    pub max_pending_upgrades: Value<usize>,
}

/// `[replica]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaTable {
    pub lease_ttl: Value<HumanDuration>,
    pub renew_deadline: Value<HumanDuration>,
    pub replica_id: Value<String>,
    pub advertise_url: Value<String>,
    pub cluster_secret_file: Value<PathBuf>,
}

/// `[telemetry]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetryTable {
    pub otlp_endpoint: Value<String>,
}

/// A duration written as the flags take it (`"15s"`, `"2m"`).
#[derive(Debug, Clone, Copy)]
pub struct HumanDuration(pub Duration);

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        parse_duration(&text).map(Self).map_err(serde::de::Error::custom)
    }
}

/// A byte count: a whole number, or a string as the flags take it (`"64MiB"`).
#[derive(Debug, Clone, Copy)]
pub struct ByteCount(pub Bytes);

impl<'de> Deserialize<'de> for ByteCount {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged, expecting = "a byte count such as 1000, \"512KiB\" or \"64MiB\"")]
        enum Given {
            Number(u64),
            Text(String),
        }
        match Given::deserialize(deserializer)? {
            Given::Number(n) => Ok(Self(Bytes(n))),
            Given::Text(text) => parse_bytes(&text).map(Self).map_err(serde::de::Error::custom),
        }
    }
}

/// One of a flag's named values (`"docker"`, `"pid-namespace"`).
#[derive(Debug, Clone, Copy)]
pub struct Choice<T>(pub T);

impl<'de, T: clap::ValueEnum> Deserialize<'de> for Choice<T> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        T::from_str(&text, false).map(Self).map_err(|_| {
            let names: Vec<String> = T::value_variants()
                .iter()
                .filter_map(|variant| variant.to_possible_value().map(|value| format!("`{}`", value.get_name())))
                .collect();
            serde::de::Error::custom(format!("`{text}` is not one of {}", names.join(", ")))
        })
    }
}

/// `sandbox_egress_allow`: a list of entries as the flag takes them
/// (`["10.0.0.5:5432", "192.168.7.0/24"]`).
#[derive(Debug, Clone)]
pub struct AllowList(pub Vec<Allow>);

impl<'de> Deserialize<'de> for AllowList {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let entries = Vec::<String>::deserialize(deserializer)?;
        let parsed: Result<Vec<Allow>, String> = entries.iter().map(|entry| entry.parse()).collect();
        parsed.map(Self).map_err(serde::de::Error::custom)
    }
}

impl FileValue for AllowList {
    type Target = Vec<Allow>;
    fn into_target(self) -> Vec<Allow> {
        self.0
    }
}

/// What a file value becomes in the flags' struct.
pub trait FileValue {
    type Target;
    fn into_target(self) -> Self::Target;
}

macro_rules! as_is {
    ($($t:ty),*) => {$(
        impl FileValue for $t {
            type Target = $t;
            fn into_target(self) -> $t {
                self
            }
        }
    )*};
}
as_is!(SocketAddr, String, PathBuf, usize, u32, u64, f64, bool, Secret);

impl FileValue for HumanDuration {
    type Target = Duration;
    fn into_target(self) -> Duration {
        self.0
    }
}

impl FileValue for ByteCount {
    type Target = Bytes;
    fn into_target(self) -> Bytes {
        self.0
    }
}

impl<T> FileValue for Choice<T> {
    type Target = T;
    fn into_target(self) -> T {
        self.0
    }
}

/// The store's path or URL (`--store` takes any bytes; the file, text).
#[derive(Debug, Clone, Deserialize)]
#[serde(transparent)]
pub struct StoreText(String);

impl FileValue for StoreText {
    type Target = StoreArg;
    fn into_target(self) -> StoreArg {
        StoreArg(self.0.into())
    }
}

/// A file read, with its text (the values' spans index it).
#[derive(Debug)]
pub struct Loaded {
    pub path: PathBuf,
    pub text: String,
}

impl Loaded {
    /// Reads and parses `path`: an unknown key, a value of the wrong type
    /// or broken TOML is refused with the file, the line and the key.
    pub fn read(path: &Path) -> Result<(Self, FileConfig), ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_owned(), source })?;
        let values = parse(path, &text)?;
        refuse_exposed_secrets(path, &values)?;
        Ok((Self { path: path.to_owned(), text }, values))
    }

    /// The line (from 1) of a byte offset into the file.
    pub fn line_of(&self, offset: usize) -> usize {
        line_of(&self.text, offset)
    }
}

/// A file holding the API key or a PostgreSQL URL (and so, most likely,
/// its password) is refused when every local user can read it, as the API
/// key file is: either opens the whole deployment.
fn refuse_exposed_secrets(path: &Path, values: &FileConfig) -> Result<(), ConfigError> {
    use std::os::unix::fs::PermissionsExt as _;
    let url = values.store.as_ref().is_some_and(|store| {
        let store = &store.get_ref().0;
        store.starts_with("postgres://") || store.starts_with("postgresql://")
    });
    let secret = match (&values.api_key, url) {
        (Some(_), _) => "api_key",
        (None, true) => "a PostgreSQL store URL",
        (None, false) => return Ok(()),
    };
    let mode = std::fs::metadata(path)
        .map_err(|source| ConfigError::Read { path: path.to_owned(), source })?
        .permissions()
        .mode()
        & 0o777;
    if mode & 0o007 != 0 {
        return Err(ConfigError::Invalid(format!(
            "the configuration file {} holds {secret} and is readable by every user (mode {mode:o}): chmod 600 it \
             (or 640 for its group)",
            path.display()
        )));
    }
    Ok(())
}

/// Parses `text`, the contents of `path`.
pub fn parse(path: &Path, text: &str) -> Result<FileConfig, ConfigError> {
    toml::from_str(text).map_err(|error| describe(path, text, &error))
}

fn line_of(text: &str, offset: usize) -> usize {
    text.as_bytes()[..offset.min(text.len())].iter().filter(|b| **b == b'\n').count() + 1
}

/// `standby.toml:7: unknown key `pool_sise` in [pool] (...)`: the key and
/// its table are read from the line the error points at, since the
/// parser's message names neither for a wrong type.
fn describe(path: &Path, text: &str, error: &toml::de::Error) -> ConfigError {
    let message = error.message().trim().replace("unknown field", "unknown key");
    let Some(span) = error.span() else {
        return ConfigError::File { path: path.to_owned(), line: None, message };
    };
    let line = line_of(text, span.start);
    let line_text = text.lines().nth(line - 1).unwrap_or_default();
    let table = text
        .lines()
        .take(line - 1)
        .filter_map(|line| line.trim().strip_prefix('[').and_then(|rest| rest.split(']').next()))
        .last()
        .map(|table| format!(" in [{}]", table.trim()))
        .unwrap_or_default();
    let message = match (message.split_once(", expected"), line_text.split_once('=')) {
        (Some((unknown, expected)), _) if unknown.starts_with("unknown key") => {
            format!("{unknown}{table}; expected{expected}")
        }
        // The parser's message may quote the value: never a secret's.
        (_, Some((key, _))) if SECRET_KEYS.contains(&key.trim()) => format!("`{}`{table}: not a string", key.trim()),
        (_, Some((key, _))) => format!("`{}`{table}: {message}", key.trim()),
        _ => format!("{message}{table}"),
    };
    ConfigError::File { path: path.to_owned(), line: Some(line), message }
}
