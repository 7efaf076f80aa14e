//! The merge and every refusal, one by one, and the example file of
//! docs/operations.md: it parses and shows only defaults.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args as _, FromArgMatches as _};

use super::flags::{ProviderKind, Serve};
use super::{Config, ConfigError, ProviderConfig, Settings, Source};
use crate::provider::docker::{Egress, OnStop};

/// `serve` with `args` (without the word `serve`), merged.
fn settings(args: &[&str]) -> Result<Settings, ConfigError> {
    let command = Serve::augment_args(clap::Command::new("serve"));
    let matches = command.try_get_matches_from(std::iter::once("serve").chain(args.iter().copied())).expect("flags");
    let serve = Serve::from_arg_matches(&matches).expect("the flags' struct");
    Settings::merge(serve, (None, None), &matches)
}

/// A file of `text` in a fresh directory (mode 0600), and the directory.
fn file(text: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("a temp dir");
    let path = dir.path().join("standby.toml");
    std::fs::write(&path, text).expect("write the file");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    (dir, path)
}

fn with_file(text: &str, args: &[&str]) -> Result<Settings, ConfigError> {
    let (_dir, path) = file(text);
    let path = path.to_str().expect("a UTF-8 path").to_owned();
    let mut all = vec!["--config", &path];
    all.extend_from_slice(args);
    settings(&all)
}

fn refusal(result: Result<impl std::fmt::Debug, ConfigError>) -> String {
    let error = result.expect_err("refused");
    let mut text = error.to_string();
    let mut source = std::error::Error::source(&error);
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

/// A configuration that validates: the spool provider needs no agent.
const VALID: &[&str] = &["--provider", "spool", "--api-key", "k"];

fn validate(extra: &[&str]) -> Result<Config, ConfigError> {
    let mut args = VALID.to_vec();
    args.extend_from_slice(extra);
    Config::validate(&settings(&args).expect("merged"))
}

#[test]
fn an_unknown_key_is_refused_with_the_file_its_line_and_its_table() {
    let message = refusal(with_file("listen = \"127.0.0.1:9000\"\n\n[pool]\npool_size = 4\npool_sise = 3\n", &[]));
    assert!(message.contains("standby.toml:5: unknown key `pool_sise` in [pool]"), "{message}");
    assert!(message.contains("expected one of `pool_size`"), "{message}");
    let message = refusal(with_file("[poool]\npool_size = 4\n", &[]));
    assert!(message.contains("standby.toml:1: unknown key `poool`"), "{message}");
    let message = refusal(with_file("lisen = \"127.0.0.1:9000\"\n", &[]));
    assert!(message.contains("standby.toml:1: unknown key `lisen`"), "{message}");
}

#[test]
fn a_wrong_type_is_refused_naming_the_key_and_its_line() {
    let message = refusal(with_file("# a comment\n[pool]\npool_size = \"four\"\n", &[]));
    assert!(message.contains("standby.toml:3: `pool_size` in [pool]: invalid type"), "{message}");
    let message = refusal(with_file("[sandbox]\nstop_grace = \"soon\"\n", &[]));
    assert!(message.contains("standby.toml:2: `stop_grace` in [sandbox]"), "{message}");
    assert!(message.contains("is not a duration"), "{message}");
    let message = refusal(with_file("provider = \"nomad\"\n", &[]));
    assert!(message.contains("standby.toml:1: `provider`: `nomad` is not one of `local`"), "{message}");
    let message = refusal(with_file("[bounds]\nlog_cap = \"lots\"\n", &[]));
    assert!(message.contains("standby.toml:2: `log_cap` in [bounds]"), "{message}");
    let message = refusal(with_file("api_key = 123456789\n", &[]));
    assert!(message.contains("standby.toml:1: `api_key`: not a string"), "{message}");
    assert!(!message.contains("123456789"), "a secret's value is never quoted: {message}");
    let message = refusal(with_file("listen = [1, 2]\n", &[]));
    assert!(message.contains("standby.toml:1: `listen`"), "{message}");
}

#[test]
fn broken_toml_and_a_missing_file_are_refused() {
    let message = refusal(with_file("listen = \n", &[]));
    assert!(message.contains("standby.toml:1:"), "{message}");
    let message = refusal(settings(&["--config", "/nonexistent/standby.toml"]));
    assert!(message.contains("cannot read the configuration file /nonexistent/standby.toml"), "{message}");
}

#[test]
fn a_file_with_a_secret_readable_by_every_user_is_refused() {
    for text in ["api_key = \"k\"\n", "store = \"postgres://u:pw@db/standby\"\n"] {
        let (_dir, path) = file(text);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let message = refusal(settings(&["--config", path.to_str().expect("UTF-8")]));
        assert!(message.contains("is readable by every user (mode 644)"), "{message}");
    }
    let (_dir, path) = file("listen = \"127.0.0.1:9000\"\n");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    assert!(settings(&["--config", path.to_str().expect("UTF-8")]).is_ok(), "no secret: any mode");
}

#[test]
fn a_flag_beats_the_file_which_beats_the_default_and_each_source_is_kept() {
    let text = "data_dir = \"/srv/standby\"\n[pool]\npool_size = 4\nrunning_cap = 8\n";
    let merged = with_file(text, &["--pool-size", "5"]).expect("merged");
    assert_eq!(merged.serve.pool.pool_size, 5);
    assert_eq!(merged.source("pool", "pool_size"), Some(&Source::Flag("--pool-size".into())));
    assert_eq!(merged.serve.pool.running_cap, 8);
    assert!(matches!(merged.source("pool", "running_cap"), Some(Source::File { line: 4, .. })));
    assert_eq!(merged.serve.data_dir, Path::new("/srv/standby"));
    assert!(matches!(merged.source("", "data_dir"), Some(Source::File { line: 1, .. })));
    assert_eq!(merged.serve.pool.warm_idle, Duration::from_secs(300));
    assert_eq!(merged.source("pool", "warm_idle"), Some(&Source::Default));
    assert_eq!(merged.source("", "public_url"), Some(&Source::Unset));
    let alias = with_file(text, &["--min-ready", "6"]).expect("merged");
    assert_eq!(alias.serve.pool.pool_size, 6, "the alias is the flag");
}

/// Every key of the file is merged: a file giving each a value other than
/// its default leaves no key at its default.
#[test]
fn every_key_of_the_file_reaches_the_settings() {
    let text = r#"
log = "debug"
listen = "127.0.0.1:9000"
public_url = "http://example"
data_dir = "/srv"
store = "/srv/x.db"
spec = "/srv/spec.json"
api_key_file = "/srv/key"
secret_key_file = "/srv/secret.key"
provider = "docker"
inject_latency = "5ms"
[sandbox]
heartbeat_interval = "1s"
max_attempts = 9
launch_timeout = "1s"
run_lost_after = "1s"
linger = "1s"
stop_grace = "1s"
agent_log = "debug"
[pool]
pool_size = 9
running_cap = 9
max_preparing = 3
standby_ttl = "1s"
warm_idle = "1s"
park_stopped = false
auto_stop = 9
auto_archive = 9
auto_delete = 9
provider_minute = "1s"
resume_timeout = "1s"
[local]
agent_bin = "/srv/standby"
sandbox_containment = "process-group"
[docker]
image = "x"
docker_network = "y"
sandbox_cpus = 1.5
sandbox_memory = "1GiB"
sandbox_pids = 9
on_stop = "remove"
sandbox_egress = "none"
sandbox_egress_allow = ["10.0.0.5:5432", "192.168.7.0/24"]
sandbox_runtime = "runsc"
snapshot_keep = 2
snapshot_max_age = "1d"
[kubernetes]
kubernetes_namespace = "sandboxes"
kubernetes_pod_template = "/srv/pod.yaml"
kubernetes_workspace_size = "5Gi"
kubernetes_storage_class = "fast"
kubernetes_instance = "prod"
kubernetes_api = "agent-sandbox"
kubernetes_warm_pool = 3
[spool]
spool_dir = "/srv/spool"
[bounds]
log_cap = 9
run_retention = "1s"
idempotency_window = "1s"
[listener]
header_timeout = "1s"
body_timeout = "1s"
max_connections = 9
max_pending_upgrades = 9
[replica]
lease_ttl = "1s"
renew_deadline = "800ms"
replica_id = "r"
advertise_url = "http://r"
cluster_secret_file = "/srv/cluster"
[telemetry]
otlp_endpoint = "http://collector:4318"
"#;
    let merged = with_file(text, &[]).expect("merged");
    let not_from_file: Vec<_> = merged
        .entries
        .iter()
        .filter(|entry| !matches!(entry.source, Source::File { .. }))
        .map(|entry| format!("[{}] {}", entry.table, entry.key))
        .collect();
    assert_eq!(not_from_file, ["[] api_key"], "api_key is left out: the file gives api_key_file");
    assert_eq!(merged.log.as_deref(), Some("debug"));
    assert_eq!(merged.serve.docker.sandbox_memory.map(|bytes| bytes.0), Some(1 << 30));
    assert_eq!(merged.serve.docker.on_stop, OnStop::Remove);
    assert_eq!(merged.serve.docker.sandbox_egress, Egress::Nothing);
    let allow: Vec<String> = merged.serve.docker.sandbox_egress_allow.iter().map(ToString::to_string).collect();
    assert_eq!(allow, ["10.0.0.5/32:5432", "192.168.7.0/24"]);
    assert_eq!(merged.serve.docker.sandbox_runtime.as_deref(), Some("runsc"));
    assert_eq!(merged.serve.docker.snapshot_keep, 2);
    assert_eq!(merged.serve.docker.snapshot_max_age, Duration::from_secs(86_400));
    assert_eq!(merged.serve.pool.max_preparing, 3);
    assert_eq!(merged.serve.local.sandbox_containment, crate::containment::ContainmentChoice::ProcessGroup);
    assert!(!merged.serve.pool.park_stopped);
    // What `config` prints is itself a file that gives the same values.
    let printed = merged.render();
    let again = with_file(&printed, &[]).expect("the printed configuration parses");
    let values = |settings: &Settings| settings.entries.iter().map(|entry| entry.value.clone()).collect::<Vec<_>>();
    assert_eq!(values(&again), values(&merged), "{printed}");
}

#[test]
fn config_masks_the_api_key_and_the_store_password() {
    let merged =
        settings(&["--api-key", "hunter2-key", "--store", "postgres://standby:hunter2@db/standby"]).expect("merged");
    let printed = merged.render();
    assert!(!printed.contains("hunter2"), "{printed}");
    assert!(printed.contains("api_key = \"[REDACTED]\""), "{printed}");
    assert!(printed.contains("# flag --api-key"), "{printed}");
    assert!(printed.contains("store = \"postgres://standby:[REDACTED]@db/standby\""), "{printed}");
    assert!(printed.contains("\n# public_url"), "an unset key is commented out: {printed}");
}

#[test]
fn the_user_api_key_is_required_non_empty_and_its_file_private() {
    let spool = ["--provider", "spool"];
    let message = refusal(Config::validate(&settings(&spool).expect("merged")));
    assert!(message.contains("the user API needs a key: --api-key-file"), "{message}");
    let message = refusal(Config::validate(&settings(&["--provider", "spool", "--api-key", "  "]).expect("merged")));
    assert!(message.contains("--api-key (STANDBY_SERVER_API_KEY) is empty"), "{message}");
    let (_dir, path) = file("\n");
    let key_file = path.to_str().expect("UTF-8");
    let message =
        refusal(Config::validate(&settings(&["--provider", "spool", "--api-key-file", key_file]).expect("merged")));
    assert!(message.contains("is empty"), "{message}");
    std::fs::write(&path, "k\n").expect("write the key");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o604)).expect("chmod");
    let message =
        refusal(Config::validate(&settings(&["--provider", "spool", "--api-key-file", key_file]).expect("merged")));
    assert!(message.contains("is readable by every user (mode 604)"), "{message}");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let config = Config::validate(&settings(&["--provider", "spool", "--api-key-file", key_file]).expect("merged"));
    assert_eq!(config.expect("valid").server.api_key.expose(), "k", "trimmed");
    let missing = ["--provider", "spool", "--api-key-file", "/nonexistent/key"];
    let message = refusal(Config::validate(&settings(&missing).expect("merged")));
    assert!(message.contains("cannot read the API key file /nonexistent/key (--api-key-file)"), "{message}");
}

#[test]
fn a_spec_file_must_be_readable_and_a_spec() {
    let message = refusal(validate(&["--spec", "/nonexistent/spec.json"]));
    assert!(message.contains("cannot read the spec file /nonexistent/spec.json"), "{message}");
    let (_dir, path) = file("{\"workspace\": 3}");
    let message = refusal(validate(&["--spec", path.to_str().expect("UTF-8")]));
    assert!(message.contains("is not a valid spec"), "{message}");
}

#[test]
fn the_local_provider_needs_its_agent_binary() {
    let message = refusal(Config::validate(
        &settings(&["--api-key", "k", "--agent-bin", "/nonexistent/standby"]).expect("merged"),
    ));
    assert!(message.contains("the agent binary /nonexistent/standby does not exist"), "{message}");
    let (_dir, agent) = file("#!/bin/sh\n");
    let config = Config::validate(
        &settings(&["--api-key", "k", "--agent-bin", agent.to_str().expect("UTF-8"), "--stop-grace", "3s"])
            .expect("merged"),
    )
    .expect("valid");
    let ProviderConfig::Local(local) = &config.provider else { panic!("{:?}", config.provider) };
    assert_eq!(local.agent, agent);
    assert!(local.sandboxes.is_absolute() && local.sandboxes.ends_with("standby-data/sandboxes"));
    let options = config.local_options(local);
    assert_eq!(
        (options.stop_grace, options.minute, options.auto_archive),
        (Duration::from_secs(3), Duration::from_secs(60), 60)
    );
}

#[test]
fn the_docker_provider_refuses_a_loopback_listener() {
    let message = refusal(Config::validate(
        &settings(&["--api-key", "k", "--provider", "docker", "--docker-network", "net"]).expect("merged"),
    ));
    assert!(
        message.contains("--provider docker: containers cannot reach the loopback address 127.0.0.1:8080"),
        "{message}"
    );
    assert!(message.contains("`net`"), "{message}");
    let args = ["--api-key", "k", "--provider", "docker", "--listen", "0.0.0.0:0", "--sandbox-memory", "2GiB"];
    let config = Config::validate(&settings(&args).expect("merged")).expect("valid");
    let ProviderConfig::Docker(docker) = &config.provider else { panic!("{:?}", config.provider) };
    let options = config.docker_options(docker, "instance".into());
    assert_eq!(options.limits.memory, Some(2 << 30));
    assert_eq!((options.stop_grace, options.auto_delete), (Duration::from_secs(10), 1440));
    assert!(options.log_dir.ends_with("standby-data/sandbox-logs"));
    assert_eq!(options.on_stop, OnStop::Keep, "a clean stop keeps the containers unless told");
}

#[test]
fn on_stop_remove_is_taken_from_the_flag_the_variable_or_the_file_and_refused_for_replicas() {
    let docker = ["--api-key", "k", "--provider", "docker", "--listen", "0.0.0.0:0"];
    let with = |extra: &[&str]| {
        let mut args = docker.to_vec();
        args.extend_from_slice(extra);
        Config::validate(&settings(&args).expect("merged"))
    };
    let config = with(&["--on-stop", "remove"]).expect("valid");
    let ProviderConfig::Docker(options) = &config.provider else { panic!("{:?}", config.provider) };
    assert_eq!(options.on_stop, OnStop::Remove);
    let merged = with_file("[docker]\non_stop = \"remove\"\n", &docker).expect("merged");
    assert_eq!(merged.serve.docker.on_stop, OnStop::Remove);
    assert!(matches!(merged.source("docker", "on_stop"), Some(Source::File { line: 2, .. })));
    let message = refusal(with_file("[docker]\non_stop = \"wipe\"\n", &[]));
    assert!(message.contains("`on_stop` in [docker]: `wipe` is not one of `keep`, `remove`"), "{message}");
    let replica = ["--on-stop", "remove", "--store", "postgres://u:pw@db/standby"];
    let message = refusal(with(&replica));
    assert!(message.contains("--on-stop remove: on a PostgreSQL store"), "{message}");
    assert!(with(&["--store", "postgres://u:pw@db/standby"]).is_err_and(|e| !e.to_string().contains("on-stop")));
}

#[test]
fn the_running_cap_must_hold_the_pool() {
    let message = refusal(validate(&["--pool-size", "5", "--running-cap", "4"]));
    assert!(message.contains("--running-cap 4 cannot hold --pool-size 5 standbys"), "{message}");
    assert!(validate(&["--pool-size", "5", "--running-cap", "0"]).is_ok(), "0: no cap");
    assert!(validate(&["--pool-size", "5", "--running-cap", "5"]).is_ok());
}

#[test]
fn a_provider_minute_and_the_listener_timeouts_must_be_longer_than_zero() {
    let message = refusal(validate(&["--provider-minute", "0s"]));
    assert!(message.contains("--provider-minute must be longer than zero"), "{message}");
    let message = refusal(validate(&["--header-timeout", "0s"]));
    assert!(message.contains("--header-timeout must be longer than zero"), "{message}");
    let message = refusal(validate(&["--body-timeout", "0s"]));
    assert!(message.contains("--body-timeout must be longer than zero"), "{message}");
    let message = refusal(validate(&["--max-connections", "0"]));
    assert!(message.contains("--max-connections must be at least 1"), "{message}");
    let config =
        validate(&["--max-connections", "7", "--max-pending-upgrades", "0", "--max-attempts", "0"]).expect("valid");
    assert_eq!(config.server.listener.max_connections, 7);
    assert_eq!(config.server.listener.max_pending_upgrades, 1, "raised to one");
    assert_eq!(config.server.max_attempts, 1, "raised to one");
}

#[test]
fn a_replica_is_checked_only_on_a_postgresql_store() {
    let postgres = ["--store", "postgres://u@db/standby"];
    assert!(validate(&["--lease-ttl", "1ms"]).is_ok(), "SQLite: no replica, its flags unused");
    let message = refusal(validate(&[&postgres[..], &["--lease-ttl", "299ms"]].concat()));
    assert!(message.contains("--lease-ttl must be at least 300ms"), "{message}");
    let message = refusal(validate(&[&postgres[..], &["--replica-id", " "]].concat()));
    assert!(message.contains("--replica-id is empty"), "{message}");
    let message = refusal(validate(&[&postgres[..], &["--advertise-url", "https://r"]].concat()));
    assert!(
        message.contains("--advertise-url must be a plain http:// URL of this replica, not `https://r`"),
        "{message}"
    );
    let message = refusal(validate(&postgres));
    assert!(message.contains("give the secret the replicas share with --cluster-secret-file"), "{message}");
    let (_dir, secret) = file("short");
    let secret_flag = ["--cluster-secret-file", secret.to_str().expect("UTF-8")];
    let message = refusal(validate(&[&postgres[..], &secret_flag].concat()));
    assert!(message.starts_with("--cluster-secret-file: the cluster secret file"), "{message}");
    std::fs::write(&secret, "0123456789abcdef0123456789abcdef").expect("write the secret");
    let config = validate(&[&postgres[..], &secret_flag, &["--replica-id", " r1 "]].concat()).expect("valid");
    let cluster = config.cluster.expect("a replica");
    assert_eq!((cluster.replica_id.as_str(), cluster.times.ttl), ("r1", Duration::from_secs(10)));
    assert_eq!(cluster.times.renew_deadline, Duration::from_secs(8), "four fifths of the TTL");
    let renew = |deadline: &str| {
        let flags = [&postgres[..], &secret_flag, &["--renew-deadline", deadline]].concat();
        validate(&flags).map(|config| config.cluster.expect("a replica").times.renew_deadline)
    };
    assert_eq!(renew("5s").expect("valid"), Duration::from_secs(5));
    for refused in ["10s", "12s", "3s"] {
        let message = refusal(renew(refused));
        assert!(message.contains("--renew-deadline") && message.contains("below --lease-ttl"), "{message}");
    }
}

#[test]
fn the_spool_provider_defaults_to_the_data_directory() {
    let config = validate(&["--data-dir", "/srv/standby"]).expect("valid");
    assert_eq!(config.provider, ProviderConfig::Spool { dir: PathBuf::from("/srv/standby/spool") });
    assert_eq!(config.secret_key_file, Path::new("/srv/standby/secret.key"));
    assert!(validate(&[]).expect("valid").cluster.is_none());
}

/// The ```toml block of docs/operations.md, "Configuration file".
fn documented_example() -> String {
    let doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/operations.md"))
        .expect("read docs/operations.md");
    let start = doc.find("```toml\n").expect("a ```toml block in docs/operations.md") + "```toml\n".len();
    let end = doc[start..].find("```").expect("the block ends") + start;
    doc[start..end].to_owned()
}

#[test]
fn the_documented_example_parses_shows_only_defaults_and_every_key() {
    let example = documented_example();
    let defaults = settings(&[]).expect("defaults");
    let merged = with_file(&example, &[]).expect("the documented example is a valid configuration file");
    let mut table = String::new();
    let mut shown = Vec::new();
    for line in example.lines() {
        let line = line.trim();
        if let Some(name) = line.strip_prefix('[') {
            table = name.trim_end_matches(']').to_owned();
        } else if let Some((key, _)) = line.trim_start_matches("# ").split_once(" =") {
            shown.push((table.clone(), key.trim().to_owned(), !line.starts_with('#')));
        }
    }
    for (entry, default) in merged.entries.iter().zip(&defaults.entries) {
        let name = format!("[{}] {}", entry.table, entry.key);
        let found = shown.iter().find(|(table, key, _)| table == entry.table && key == entry.key);
        let Some((_, _, given)) = found else { panic!("{name} is missing from the example") };
        assert_eq!(entry.value, default.value, "{name}: the example shows a value other than the default");
        let has_default = default.source == Source::Default;
        assert_eq!(*given, has_default, "{name}: a key with a default is shown, one without is commented out");
    }
    assert_eq!(shown.len(), defaults.entries.len(), "the example names no key the server does not know: {shown:?}");
}

/// Every flag of `serve` has its row in docs/operations.md's flags table
/// (`| \`--flag\`` … with its variable), and every row there is a flag of
/// `serve` (or the global `--log`).
#[test]
fn the_flags_table_of_the_operations_guide_lists_every_flag_of_serve() {
    use std::collections::BTreeMap;
    let doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/operations.md"))
        .expect("read docs/operations.md");
    let table = doc.find("| flag | env | default | meaning |").expect("the flags table of docs/operations.md");
    let documented: BTreeMap<String, String> = doc[table..]
        .lines()
        .take_while(|line| line.starts_with('|'))
        .filter(|line| line.starts_with("| `--"))
        .filter_map(|line| {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let flag = cells.get(1)?.split('`').nth(1)?;
            let env = cells.get(2)?.trim_matches('`');
            Some((flag.to_owned(), env.to_owned()))
        })
        .collect();
    let command = Serve::augment_args(clap::Command::new("serve"));
    let flags: BTreeMap<String, String> = command
        .get_arguments()
        .filter_map(|arg| {
            let env = arg.get_env().map(|env| env.to_string_lossy().into_owned()).unwrap_or_default();
            Some((format!("--{}", arg.get_long()?), env))
        })
        .collect();
    let undocumented: Vec<&String> = flags.keys().filter(|flag| !documented.contains_key(*flag)).collect();
    let unknown: Vec<&String> =
        documented.keys().filter(|flag| !flags.contains_key(*flag) && *flag != "--log").collect();
    assert!(undocumented.is_empty(), "flags of `serve` missing from docs/operations.md's table: {undocumented:?}");
    assert!(unknown.is_empty(), "rows of docs/operations.md's flags table `serve` does not take: {unknown:?}");
    for (flag, env) in &flags {
        assert_eq!(&documented[flag], env, "the variable docs/operations.md gives {flag}");
    }
}

#[test]
fn the_kubernetes_deployments_configuration_file_holds_only_keys_the_server_knows() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes/base/config.toml");
    let text = std::fs::read_to_string(&path).expect("read deploy/kubernetes/base/config.toml");
    let merged = with_file(&text, &[]).expect("deploy/kubernetes/base/config.toml parses");
    assert_eq!(merged.serve.provider, ProviderKind::Kubernetes);
    assert_eq!(merged.serve.kubernetes.kubernetes_instance.as_deref(), Some("standby"));
}

#[test]
fn the_egress_allow_list_comes_from_repeated_flags_a_comma_list_or_the_file_and_a_bad_entry_is_named() {
    let docker = ["--provider", "docker", "--listen", "0.0.0.0:8080"];
    let mut args = docker.to_vec();
    args.extend(["--sandbox-egress-allow", "10.0.0.5:5432", "--sandbox-egress-allow", "172.18.0.1/32,192.168.7.0/24"]);
    let merged = with_file("", &args).expect("merged");
    let allow: Vec<String> = merged.serve.docker.sandbox_egress_allow.iter().map(ToString::to_string).collect();
    assert_eq!(allow, ["10.0.0.5/32:5432", "172.18.0.1/32", "192.168.7.0/24"]);
    assert_eq!(merged.serve.docker.sandbox_egress, Egress::Public, "public unless told");
    let message = refusal(with_file("[docker]\nsandbox_egress_allow = [\"10.0.0.5:http\"]\n", &[]));
    assert!(message.contains("`10.0.0.5:http` is not an allow entry"), "{message}");
    let message = refusal(with_file("[docker]\nsandbox_egress = \"open\"\n", &[]));
    assert!(message.contains("`open` is not one of `public`, `none`, `unfiltered`"), "{message}");
}

/// `--otlp-endpoint`: checked by the exporter's own rule (the refusal
/// names the flag and the value, without a password), kept as given, and
/// shown by `config` without the password of its userinfo.
#[test]
fn the_otlp_endpoint_is_checked_kept_and_shown_masked() {
    assert_eq!(validate(&[]).expect("valid").server.otlp_endpoint, None, "unset: nothing traced");
    let config = validate(&["--otlp-endpoint", "http://collector:4318"]).expect("valid");
    assert_eq!(config.server.otlp_endpoint.as_deref(), Some("http://collector:4318"));
    let refused = validate(&["--otlp-endpoint", "grpc://u:hunter2@collector:4317"]).expect_err("not http").to_string();
    assert!(refused.contains("--otlp-endpoint") && refused.contains("grpc://"), "{refused}");
    assert!(!refused.contains("hunter2"), "{refused}");
    let shown = settings(&["--otlp-endpoint", "http://u:hunter2@collector:4318/otlp"]).expect("merged");
    let entry = shown.entries.iter().find(|entry| entry.key == "otlp_endpoint").expect("shown");
    assert_eq!(entry.value.as_deref(), Some("\"http://u:[REDACTED]@collector:4318/otlp\""));
}
