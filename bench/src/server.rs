//! A `standby-server serve` child process and the few user-API calls the
//! benchmarks make.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, Result, anyhow, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::process::{Child, Command};

/// The API key of every server the benchmarks start (loopback only).
pub const API_KEY: &str = "standby-bench-key";

/// A running `standby-server serve`.
#[derive(Debug)]
pub struct ServerProc {
    pub name: String,
    pub url: String,
    pub pid: u32,
    log: PathBuf,
    child: Child,
    http: reqwest::Client,
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
    /// Starts `server_bin serve` on `127.0.0.1:0` with `data_dir` and the
    /// extra `args`; returns once it printed its URL.
    pub async fn start(name: &str, server_bin: &Path, data_dir: &Path, args: &[OsString]) -> Result<Self> {
        std::fs::create_dir_all(data_dir).with_context(|| format!("creating {}", data_dir.display()))?;
        let log = data_dir.join("server.log");
        let log_file = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let mut child = Command::new(server_bin)
            .arg("serve")
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--data-dir")
            .arg(data_dir)
            .args(args)
            .env("STANDBY_SERVER_API_KEY", API_KEY)
            .env("STANDBY_SERVER_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log_file)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", server_bin.display()))?;
        let pid = child.id().ok_or_else(|| anyhow!("the server {name} exited at once"))?;
        let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout of the server"))?;
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .map_err(|_| anyhow!("the server {name} printed no URL within 60 s (log: {})", log.display()))?
            .context("reading the server's stdout")?
            .ok_or_else(|| anyhow!("the server {name} exited before listening:\n{}", tail(&log, 20)))?;
        let url = line
            .strip_prefix("standby-server listening on ")
            .ok_or_else(|| anyhow!("unexpected first line from the server: {line}"))?
            .trim()
            .to_owned();
        // Nothing else is printed on stdout; keep reading so it never blocks.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Self { name: name.to_owned(), url, pid, log, child, http: http_client()? })
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Option<&Value>) -> Result<Value> {
        let mut request = self.http.request(method.clone(), format!("{}{path}", self.url)).bearer_auth(API_KEY);
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = request.send().await.with_context(|| format!("{method} {path} on {}", self.name))?;
        let status = response.status();
        let text = response.text().await.with_context(|| format!("{method} {path} on {}", self.name))?;
        if !status.is_success() {
            bail!("{method} {path} on {}: {status}: {text}", self.name);
        }
        Ok(serde_json::from_str(&text).unwrap_or(Value::String(text)))
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
        tail(&self.log, lines)
    }

    /// SIGTERM, then SIGKILL if it has not exited within `grace`; reaped.
    pub async fn stop(mut self, grace: Duration) -> Result<()> {
        let pid = Pid::from_raw(i32::try_from(self.pid).unwrap_or(i32::MAX));
        let _ = kill(pid, Signal::SIGTERM);
        match tokio::time::timeout(grace, self.child.wait()).await {
            Ok(status) => {
                status.with_context(|| format!("waiting for the server {}", self.name))?;
            }
            Err(_) => {
                let _ = self.child.kill().await;
                bail!("the server {} did not stop within {grace:?} after SIGTERM: killed", self.name);
            }
        }
        Ok(())
    }
}

/// The last `lines` lines of a text file.
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
