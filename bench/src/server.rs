//! A `standby-server serve` child process (the tests' [`ServerProcess`],
//! started from the build being measured) and the few user-API calls the
//! benchmarks make, as errors a benchmark records instead of the tests'
//! panics.

use std::ffi::OsString;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, Result, anyhow, bail};
use nix::sys::signal::Signal;
use serde_json::Value;
use standby_e2e::server_process::{ServerBuilder, ServerProcess};

pub use standby_e2e::server_process::API_KEY;

/// A running `standby-server serve`.
#[derive(Debug)]
pub struct ServerProc {
    pub name: String,
    pub url: String,
    pub pid: u32,
    process: ServerProcess,
}

/// The HTTP client of the benchmarks: plain HTTP on loopback, no proxy.
pub fn http_client() -> Result<reqwest::Client> {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(4)
        .build()
        .context("building the HTTP client")
}

impl ServerProc {
    /// Starts `server_bin serve` on a free port of 127.0.0.1 with
    /// `data_dir` (its log in `data_dir/server.log`) and the extra `args`;
    /// returns once it printed its URL.
    pub async fn start(name: &str, server_bin: &Path, data_dir: &Path, args: &[OsString]) -> Result<Self> {
        Self::start_with(name, server_bin, data_dir, args, |server| server).await
    }

    /// [`ServerProc::start`] with more of the tests' settings (a replica's
    /// cluster secret).
    pub async fn start_with(
        name: &str,
        server_bin: &Path,
        data_dir: &Path,
        args: &[OsString],
        configure: impl FnOnce(ServerBuilder) -> ServerBuilder,
    ) -> Result<Self> {
        let args: Vec<&str> = args
            .iter()
            .map(|arg| arg.to_str().ok_or_else(|| anyhow!("a server argument is not UTF-8: {arg:?}")))
            .collect::<Result<_>>()?;
        let server = ServerBuilder::of(server_bin, data_dir, &data_dir.join("server.log"), &format!("bench-{name}"))
            .args(&args)
            .env("STANDBY_SERVER_LOG", "info");
        let process = configure(server).try_start().await.map_err(|problem| anyhow!("the server {name}: {problem}"))?;
        let pid = u32::try_from(process.pid())?;
        Ok(Self { name: name.to_owned(), url: process.url(), pid, process })
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Option<&Value>) -> Result<Value> {
        let (status, answer) = self
            .process
            .try_call(method.clone(), path, Some(API_KEY), body)
            .await
            .ok_or_else(|| anyhow!("{method} {path} on {}: no answer", self.name))?;
        if !(200..300).contains(&status) {
            bail!("{method} {path} on {}: {status}: {answer}", self.name);
        }
        Ok(answer)
    }

    /// `POST /v1/runs`: the run as created.
    pub async fn submit(&self, body: &Value) -> Result<Value> {
        self.call(reqwest::Method::POST, "/v1/runs", Some(body)).await
    }

    pub async fn run(&self, id: &str) -> Result<Value> {
        self.call(reqwest::Method::GET, &format!("/v1/runs/{id}"), None).await
    }

    /// Every sandbox, following the pages of `GET /v1/sandboxes`.
    pub async fn sandboxes(&self) -> Result<Vec<Value>> {
        let mut sandboxes = Vec::new();
        let mut path = "/v1/sandboxes?limit=1000".to_owned();
        loop {
            let answer = self.call(reqwest::Method::GET, &path, None).await?;
            sandboxes.extend(answer.get("sandboxes").and_then(Value::as_array).cloned().unwrap_or_default());
            let Some(cursor) = answer.get("next_cursor").and_then(Value::as_str) else { return Ok(sandboxes) };
            path = format!("/v1/sandboxes?limit=1000&cursor={cursor}");
        }
    }

    /// One sample of `/metrics` without labels, e.g. `standby_connected_standbys`.
    pub async fn metric(&self, name: &str) -> Result<f64> {
        let text = self.call(reqwest::Method::GET, "/metrics", None).await?;
        let text = text.as_str().unwrap_or_default();
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.trim().parse::<f64>().ok())
            .ok_or_else(|| anyhow!("no metric {name} on {}", self.name))
    }

    /// Polls the run until it ended; fails on a run that did not exit 0.
    pub async fn wait_run(&self, id: &str, timeout: Duration) -> Result<Value> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let run = self.run(id).await?;
            match run.get("state").and_then(Value::as_str) {
                Some("exited") if run.get("exit_code").and_then(Value::as_i64) == Some(0) => return Ok(run),
                Some("exited" | "failed" | "cancelled") => {
                    bail!("run {id} on {} ended badly: {run}\nserver log:\n{}", self.name, self.log_tail(30))
                }
                _ => {}
            }
            if tokio::time::Instant::now() > deadline {
                bail!("run {id} on {} did not end within {timeout:?}: {run}", self.name);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn log_tail(&self, lines: usize) -> String {
        standby_e2e::server_process::tail(self.process.log_path(), lines)
    }

    /// SIGTERM, then SIGKILL if it has not exited within `grace`; reaped.
    pub async fn stop(self, grace: Duration) -> Result<()> {
        self.process
            .try_stop(Signal::SIGTERM, grace)
            .await
            .map_err(|problem| anyhow!("the server {}: {problem}", self.name))?;
        Ok(())
    }
}
