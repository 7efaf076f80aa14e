//! Flag > environment > file > default, one key at a time, and where each
//! value came from: clap knows whether a flag or a variable gave a value
//! (`ArgMatches::value_source`); a file value fills only what neither did.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{ArgMatches, Args as _};

use super::ConfigError;
use super::file::{FileConfig, FileValue, Loaded, Value};
use super::flags::{Bytes, ProviderKind, Serve, StoreArg};
use crate::containment::ContainmentChoice;
use crate::provider::docker::{Allow, Egress, OnStop};
use crate::provider::kubernetes::KubernetesApi;

/// The environment variable of `--log`, a flag of every command.
pub const LOG_ENV: &str = "STANDBY_SERVER_LOG";
/// What a secret is shown as.
const MASK: &str = "[REDACTED]";

/// Where a value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Flag(String),
    Env(String),
    File {
        path: PathBuf,
        line: usize,
    },
    Default,
    /// Neither given nor defaulted: the value is derived at start (see the
    /// flag's help).
    Unset,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Flag(flag) => write!(f, "flag {flag}"),
            Self::Env(name) => write!(f, "env {name}"),
            Self::File { path, line } => write!(f, "file {}:{line}", path.display()),
            Self::Default => f.write_str("default"),
            Self::Unset => f.write_str("unset"),
        }
    }
}

/// One key of the effective configuration, as `standby-server config`
/// shows it: a TOML value (a secret masked), or none when unset.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The table (`""`: the top level).
    pub table: &'static str,
    pub key: &'static str,
    pub value: Option<String>,
    pub source: Source,
}

/// The flags with the file merged in, not yet validated.
#[derive(Debug, Clone)]
pub struct Settings {
    /// `--log`.
    pub log: Option<String>,
    pub serve: Serve,
    pub entries: Vec<Entry>,
}

impl Settings {
    /// Merges `--config` (when given) under `serve`, whose flags and
    /// variables `matches` tells apart from defaults; `log` is the global
    /// `--log` and its source in the top-level matches.
    pub fn merge(
        mut serve: Serve,
        log: (Option<String>, Option<ValueSource>),
        matches: &ArgMatches,
    ) -> Result<Self, ConfigError> {
        let (file, values) = match serve.config.as_deref() {
            Some(path) => {
                let (loaded, values) = Loaded::read(path)?;
                (Some(loaded), values)
            }
            None => (None, FileConfig::default()),
        };
        let args = Serve::augment_args(clap::Command::new("serve"));
        let mut merge = Merge { matches, args, file, entries: Vec::new() };
        let (s, v) = (&mut serve, values);
        let mut log_value = log.0;
        let log_source = match log.1 {
            Some(ValueSource::CommandLine) => Some(Source::Flag("--log".into())),
            Some(ValueSource::EnvVariable) => Some(Source::Env(LOG_ENV.into())),
            _ => None,
        };
        merge.optional_from(log_source, "", "log", &mut log_value, v.log, Render::render);
        merge.value("", "listen", &mut s.listen, v.listen);
        merge.option("", "public_url", &mut s.public_url, v.public_url);
        merge.value("", "data_dir", &mut s.data_dir, v.data_dir);
        merge.masked("", "store", &mut s.store, v.store, mask_store);
        merge.option("", "spec", &mut s.spec, v.spec);
        merge.option("", "api_key_file", &mut s.api_key_file, v.api_key_file);
        merge.masked("", "api_key", &mut s.api_key, v.api_key, |_| quote(MASK));
        merge.option("", "secret_key_file", &mut s.secret_key_file, v.secret_key_file);
        merge.value("", "provider", &mut s.provider, v.provider);
        merge.value("", "inject_latency", &mut s.inject_latency, v.inject_latency);
        let (t, f) = (&mut s.sandbox, v.sandbox);
        merge.value("sandbox", "heartbeat_interval", &mut t.heartbeat_interval, f.heartbeat_interval);
        merge.value("sandbox", "max_attempts", &mut t.max_attempts, f.max_attempts);
        merge.value("sandbox", "launch_timeout", &mut t.launch_timeout, f.launch_timeout);
        merge.value("sandbox", "run_lost_after", &mut t.run_lost_after, f.run_lost_after);
        merge.value("sandbox", "linger", &mut t.linger, f.linger);
        merge.value("sandbox", "stop_grace", &mut t.stop_grace, f.stop_grace);
        merge.value("sandbox", "agent_log", &mut t.agent_log, f.agent_log);
        let (t, f) = (&mut s.pool, v.pool);
        merge.value("pool", "pool_size", &mut t.pool_size, f.pool_size);
        merge.value("pool", "running_cap", &mut t.running_cap, f.running_cap);
        merge.value("pool", "max_preparing", &mut t.max_preparing, f.max_preparing);
        merge.value("pool", "standby_ttl", &mut t.standby_ttl, f.standby_ttl);
        merge.value("pool", "warm_idle", &mut t.warm_idle, f.warm_idle);
        merge.value("pool", "park_stopped", &mut t.park_stopped, f.park_stopped);
        merge.value("pool", "auto_stop", &mut t.auto_stop, f.auto_stop);
        merge.value("pool", "auto_archive", &mut t.auto_archive, f.auto_archive);
        merge.value("pool", "auto_delete", &mut t.auto_delete, f.auto_delete);
        merge.value("pool", "provider_minute", &mut t.provider_minute, f.provider_minute);
        merge.value("pool", "resume_timeout", &mut t.resume_timeout, f.resume_timeout);
        let (t, f) = (&mut s.local, v.local);
        merge.option("local", "agent_bin", &mut t.agent_bin, f.agent_bin);
        merge.value("local", "sandbox_containment", &mut t.sandbox_containment, f.sandbox_containment);
        let (t, f) = (&mut s.docker, v.docker);
        merge.value("docker", "image", &mut t.image, f.image);
        merge.value("docker", "docker_network", &mut t.docker_network, f.docker_network);
        merge.option("docker", "sandbox_cpus", &mut t.sandbox_cpus, f.sandbox_cpus);
        merge.option("docker", "sandbox_memory", &mut t.sandbox_memory, f.sandbox_memory);
        merge.option("docker", "sandbox_pids", &mut t.sandbox_pids, f.sandbox_pids);
        merge.value("docker", "on_stop", &mut t.on_stop, f.on_stop);
        merge.value("docker", "sandbox_egress", &mut t.sandbox_egress, f.sandbox_egress);
        merge.value("docker", "sandbox_egress_allow", &mut t.sandbox_egress_allow, f.sandbox_egress_allow);
        merge.option("docker", "sandbox_runtime", &mut t.sandbox_runtime, f.sandbox_runtime);
        merge.value("docker", "snapshot_keep", &mut t.snapshot_keep, f.snapshot_keep);
        merge.value("docker", "snapshot_max_age", &mut t.snapshot_max_age, f.snapshot_max_age);
        let (t, f) = (&mut s.kubernetes, v.kubernetes);
        merge.option("kubernetes", "kubernetes_namespace", &mut t.kubernetes_namespace, f.kubernetes_namespace);
        merge.option(
            "kubernetes",
            "kubernetes_pod_template",
            &mut t.kubernetes_pod_template,
            f.kubernetes_pod_template,
        );
        merge.value(
            "kubernetes",
            "kubernetes_workspace_size",
            &mut t.kubernetes_workspace_size,
            f.kubernetes_workspace_size,
        );
        merge.option(
            "kubernetes",
            "kubernetes_storage_class",
            &mut t.kubernetes_storage_class,
            f.kubernetes_storage_class,
        );
        merge.option("kubernetes", "kubernetes_instance", &mut t.kubernetes_instance, f.kubernetes_instance);
        merge.value("kubernetes", "kubernetes_api", &mut t.kubernetes_api, f.kubernetes_api);
        merge.value("kubernetes", "kubernetes_warm_pool", &mut t.kubernetes_warm_pool, f.kubernetes_warm_pool);
        merge.option("spool", "spool_dir", &mut s.spool.spool_dir, v.spool.spool_dir);
        let (t, f) = (&mut s.bounds, v.bounds);
        merge.value("bounds", "log_cap", &mut t.log_cap, f.log_cap);
        merge.value("bounds", "run_retention", &mut t.run_retention, f.run_retention);
        merge.value("bounds", "idempotency_window", &mut t.idempotency_window, f.idempotency_window);
        let (t, f) = (&mut s.listener, v.listener);
        merge.value("listener", "header_timeout", &mut t.header_timeout, f.header_timeout);
        merge.value("listener", "body_timeout", &mut t.body_timeout, f.body_timeout);
        merge.option("listener", "max_connections", &mut t.max_connections, f.max_connections);
        merge.value("listener", "max_pending_upgrades", &mut t.max_pending_upgrades, f.max_pending_upgrades);
        let (t, f) = (&mut s.replica, v.replica);
        merge.value("replica", "lease_ttl", &mut t.lease_ttl, f.lease_ttl);
        merge.option("replica", "renew_deadline", &mut t.renew_deadline, f.renew_deadline);
        merge.option("replica", "replica_id", &mut t.replica_id, f.replica_id);
        merge.option("replica", "advertise_url", &mut t.advertise_url, f.advertise_url);
        merge.option("replica", "cluster_secret_file", &mut t.cluster_secret_file, f.cluster_secret_file);
        let (t, f) = (&mut s.telemetry, v.telemetry);
        merge.masked("telemetry", "otlp_endpoint", &mut t.otlp_endpoint, f.otlp_endpoint, |url| {
            quote(&mask_userinfo(url))
        });
        Ok(Self { log: log_value, serve, entries: merge.entries })
    }
}

impl Settings {
    /// Where the value of `key` in `table` (`""`: the top level) came from.
    pub fn source(&self, table: &str, key: &str) -> Option<&Source> {
        self.entries.iter().find(|entry| entry.table == table && entry.key == key).map(|entry| &entry.source)
    }

    /// `standby-server config`: every key as a line of the file, with its
    /// source; secrets masked, unset keys commented out. The output is
    /// itself a valid configuration file.
    pub fn render(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::from(
            "# The effective configuration of `standby-server serve`: flag > environment > file > default.\n",
        );
        let mut table = "";
        for entry in &self.entries {
            if entry.table != table {
                table = entry.table;
                let _ = write!(out, "\n[{table}]\n");
            }
            let line = match &entry.value {
                Some(value) => format!("{} = {value}", entry.key),
                None => format!("# {}", entry.key),
            };
            let _ = writeln!(out, "{line:<44} # {}", entry.source);
        }
        out
    }
}

/// The merge of one key after another.
struct Merge<'a> {
    matches: &'a ArgMatches,
    /// The flags' definitions: their names and variables.
    args: clap::Command,
    file: Option<Loaded>,
    entries: Vec<Entry>,
}

impl Merge<'_> {
    /// The flag or variable that gave `id` a value, if one did.
    fn given(&self, id: &str) -> Option<Source> {
        let arg = self.args.get_arguments().find(|arg| arg.get_id() == id);
        match self.matches.value_source(id) {
            Some(ValueSource::CommandLine) => {
                Some(Source::Flag(format!("--{}", arg.and_then(clap::Arg::get_long).unwrap_or(id))))
            }
            Some(ValueSource::EnvVariable) => {
                let name = arg.and_then(clap::Arg::get_env).map(|name| name.to_string_lossy().into_owned());
                Some(Source::Env(name.unwrap_or_default()))
            }
            _ => None,
        }
    }

    /// `given`, else the file's value (put through `assign`), else the
    /// default (`defaulted`) or nothing.
    fn take<F: FileValue>(
        &self,
        given: Option<Source>,
        defaulted: bool,
        file: Value<F>,
        assign: impl FnOnce(F::Target),
    ) -> Source {
        if let Some(source) = given {
            return source;
        }
        match (file, &self.file) {
            (Some(value), Some(loaded)) => {
                let line = loaded.line_of(value.span().start);
                assign(value.into_inner().into_target());
                Source::File { path: loaded.path.clone(), line }
            }
            _ if defaulted => Source::Default,
            _ => Source::Unset,
        }
    }

    fn value<F: FileValue>(&mut self, table: &'static str, key: &'static str, target: &mut F::Target, file: Value<F>)
    where
        F::Target: Render,
    {
        let source = self.take(self.given(key), true, file, |value| *target = value);
        self.entries.push(Entry { table, key, value: Some(target.render()), source });
    }

    fn option<F: FileValue>(
        &mut self,
        table: &'static str,
        key: &'static str,
        target: &mut Option<F::Target>,
        file: Value<F>,
    ) where
        F::Target: Render,
    {
        self.optional_from(self.given(key), table, key, target, file, Render::render);
    }

    /// An optional value shown as `show` makes it (a secret: masked).
    fn masked<F: FileValue>(
        &mut self,
        table: &'static str,
        key: &'static str,
        target: &mut Option<F::Target>,
        file: Value<F>,
        show: impl Fn(&F::Target) -> String,
    ) {
        self.optional_from(self.given(key), table, key, target, file, show);
    }

    fn optional_from<F: FileValue>(
        &mut self,
        given: Option<Source>,
        table: &'static str,
        key: &'static str,
        target: &mut Option<F::Target>,
        file: Value<F>,
        show: impl Fn(&F::Target) -> String,
    ) {
        let source = self.take(given, target.is_some(), file, |value| *target = Some(value));
        let source = if target.is_none() { Source::Unset } else { source };
        self.entries.push(Entry { table, key, value: target.as_ref().map(show), source });
    }
}

/// The store as `config` shows it: a PostgreSQL URL without its password.
/// A URL shown without the password of its userinfo.
fn mask_userinfo(text: &str) -> String {
    let Some((scheme, rest)) = text.split_once("://") else { return text.to_owned() };
    let (authority, tail) = rest.split_at(rest.find(['/', '?', '#']).unwrap_or(rest.len()));
    match authority.rsplit_once('@') {
        Some((userinfo, host)) if userinfo.contains(':') => {
            let user = userinfo.split(':').next().unwrap_or_default();
            format!("{scheme}://{user}:{MASK}@{host}{tail}")
        }
        _ => text.to_owned(),
    }
}

fn mask_store(store: &StoreArg) -> String {
    quote(&StoreArg::location(Some(store), std::path::Path::new("")).describe())
}

/// A value written as the file takes it.
pub trait Render {
    fn render(&self) -> String;
}

/// A TOML basic string (JSON's escapes are TOML's).
fn quote(text: &str) -> String {
    serde_json::to_string(text).unwrap_or_else(|_| format!("\"{text}\""))
}

impl Render for String {
    fn render(&self) -> String {
        quote(self)
    }
}

impl Render for PathBuf {
    fn render(&self) -> String {
        quote(&self.to_string_lossy())
    }
}

impl Render for SocketAddr {
    fn render(&self) -> String {
        quote(&self.to_string())
    }
}

macro_rules! render_plain {
    ($($t:ty),*) => {$(
        impl Render for $t {
            fn render(&self) -> String {
                self.to_string()
            }
        }
    )*};
}
render_plain!(usize, u32, u64, bool);

impl Render for f64 {
    fn render(&self) -> String {
        format!("{self:?}")
    }
}

impl Render for Duration {
    /// In the largest unit that divides it: `"24h"`, `"90s"`, `"1500ms"`.
    fn render(&self) -> String {
        let nanos = self.as_nanos();
        let units = [("h", 3_600_000_000_000), ("m", 60_000_000_000), ("s", 1_000_000_000), ("ms", 1_000_000)];
        let text = match units.iter().find(|(_, len)| nanos.is_multiple_of(*len)) {
            _ if nanos == 0 => "0s".to_owned(),
            Some((unit, len)) => format!("{}{unit}", nanos / len),
            None => format!("{nanos}ns"),
        };
        quote(&text)
    }
}

impl Render for Bytes {
    /// In the largest unit that divides it: `"64MiB"`, or a plain number.
    fn render(&self) -> String {
        let units = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
        match units.iter().find(|(_, len)| self.0 != 0 && self.0.is_multiple_of(*len)) {
            Some((unit, len)) => quote(&format!("{}{unit}", self.0 / len)),
            None => self.0.to_string(),
        }
    }
}

fn choice_name(value: &impl clap::ValueEnum) -> String {
    quote(value.to_possible_value().map(|value| value.get_name().to_owned()).unwrap_or_default().as_str())
}

impl Render for ProviderKind {
    fn render(&self) -> String {
        choice_name(self)
    }
}

impl Render for ContainmentChoice {
    fn render(&self) -> String {
        choice_name(self)
    }
}

impl Render for OnStop {
    fn render(&self) -> String {
        choice_name(self)
    }
}

impl Render for Egress {
    fn render(&self) -> String {
        choice_name(self)
    }
}

impl Render for Vec<Allow> {
    fn render(&self) -> String {
        let entries: Vec<String> = self.iter().map(|entry| quote(&entry.to_string())).collect();
        format!("[{}]", entries.join(", "))
    }
}

impl Render for KubernetesApi {
    fn render(&self) -> String {
        choice_name(self)
    }
}
