//! A real Prometheus for the monitoring tests: Debian's `prometheus` and
//! `promtool` binaries, run by the test with a configuration of its own in
//! a temp directory (never the package's service), the rules of
//! `deploy/prometheus/`, one scrape job, and a client of its HTTP API.
//!
//! Under `CI=true` a missing binary fails the test; elsewhere the test is
//! skipped, loudly.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;

use crate::server_process::free_addr;

/// The workspace's root (`deploy/` is read from there).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace root").to_owned()
}

/// The rules file every test loads.
pub fn rules_file() -> PathBuf {
    repo_root().join("deploy/prometheus/standby.rules.yml")
}

/// `name` on `PATH` (or `/usr/bin`, where Debian puts it); `None`, with a
/// loud line, when the test is to be skipped. Panics under `CI=true`
/// instead of skipping.
pub fn tool(name: &str, test: &str) -> Option<PathBuf> {
    crate::harness::system_tool(name, "prometheus", test)
}

/// A Prometheus process scraping one target every second and evaluating
/// the rules every second; killed when dropped.
#[derive(Debug)]
pub struct Prometheus {
    /// Held to be killed on drop.
    _child: tokio::process::Child,
    url: String,
    log: PathBuf,
    http: reqwest::Client,
}

/// What a scrape job is given.
#[derive(Debug)]
pub struct Target<'a> {
    pub job: &'a str,
    /// `host:port`.
    pub address: &'a str,
    /// The bearer token `/metrics` asks for.
    pub token: &'a str,
}

impl Prometheus {
    /// Starts `binary` with its configuration, data and log in `dir`, and
    /// waits until it answers `/-/ready`.
    pub async fn start(binary: &Path, dir: &Path, target: &Target<'_>) -> Self {
        let config = dir.join("prometheus.yml");
        let token_file = dir.join("scrape-token");
        std::fs::write(&token_file, target.token).expect("write the scrape token");
        let text = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - {rules}\n\
             scrape_configs:\n  - job_name: {job}\n    authorization:\n      credentials_file: {token}\n\
             \x20   static_configs:\n      - targets: ['{address}']\n",
            rules = rules_file().display(),
            job = target.job,
            token = token_file.display(),
            address = target.address,
        );
        std::fs::write(&config, text).expect("write prometheus.yml");
        let listen = free_addr();
        let log = dir.join("prometheus.log");
        let stderr = std::fs::File::create(&log).expect("create prometheus.log");
        let child = tokio::process::Command::new(binary)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .arg(format!("--web.listen-address={listen}"))
            .stdout(Stdio::null())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|error| panic!("start {}: {error}", binary.display()));
        let prometheus = Self { _child: child, url: format!("http://{listen}"), log, http: reqwest::Client::new() };
        prometheus
            .until("Prometheus to be ready", Duration::from_secs(60), async || {
                let ready = prometheus.http.get(format!("{}/-/ready", prometheus.url)).send().await.ok()?;
                ready.status().is_success().then_some(())
            })
            .await;
        prometheus
    }

    /// The result vector of an instant query now (`/api/v1/query`); panics
    /// on an error answer (a query Prometheus refuses is a broken query).
    pub async fn query(&self, expr: &str) -> Vec<Value> {
        let url = reqwest::Url::parse_with_params(&format!("{}/api/v1/query", self.url), [("query", expr)])
            .unwrap_or_else(|error| panic!("query `{expr}`: {error}"));
        let response = self
            .http
            .get(url)
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .unwrap_or_else(|error| panic!("query `{expr}`: {error}\n{}", self.logs()));
        let body: Value = response.json().await.unwrap_or_else(|error| panic!("query `{expr}`: {error}"));
        assert_eq!(body["status"], "success", "query `{expr}`: {body}");
        body["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    /// Polls until `check` gives a value (Prometheus scrapes and evaluates
    /// on its own clock: no event tells the test); panics with its log on
    /// timeout.
    pub async fn until<T>(&self, what: &str, timeout: Duration, check: impl AsyncFnMut() -> Option<T>) -> T {
        crate::server_process::poll(what, timeout, Duration::from_millis(200), check, || self.logs()).await
    }

    /// The tail of its log, for failures.
    pub fn logs(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(30).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    }
}

/// Whether a sample of an instant vector is a finite number (not `NaN`,
/// which a ratio or a quantile over no observation gives).
pub fn finite(sample: &Value) -> bool {
    sample["value"][1].as_str().and_then(|text| text.parse::<f64>().ok()).is_some_and(f64::is_finite)
}

/// The `expr` of every target of every panel of a Grafana dashboard,
/// panels inside rows included.
pub fn dashboard_queries(dashboard: &Value) -> Vec<String> {
    fn walk(panels: &Value, out: &mut Vec<String>) {
        for panel in panels.as_array().into_iter().flatten() {
            for target in panel["targets"].as_array().into_iter().flatten() {
                if let Some(expr) = target["expr"].as_str() {
                    out.push(expr.to_owned());
                }
            }
            walk(&panel["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

/// The name of every `record:` of a rules file.
pub fn recorded(rules: &Value) -> Vec<String> {
    let groups = rules["groups"].as_array().into_iter().flatten();
    let rules = groups.flat_map(|group| group["rules"].as_array().into_iter().flatten());
    let mut names: Vec<String> = rules.filter_map(|rule| rule["record"].as_str().map(str::to_owned)).collect();
    names.dedup();
    names
}
