//! How the demo talks to its server and to whoever watches: the user API
//! client, the progress line on stderr, and the agents' logs for a failure
//! message.

use std::io::{IsTerminal, Write};
use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use standby_protocol::Secret;

use super::DemoError;

/// A line on stderr that says what the demo waits for, rewritten in place
/// on a terminal.
pub(super) struct Progress {
    terminal: bool,
    last: String,
}

impl Progress {
    pub(super) fn new() -> Self {
        Self { terminal: std::io::stderr().is_terminal(), last: String::new() }
    }

    pub(super) fn show(&mut self, line: &str) {
        if line == self.last {
            return;
        }
        let mut stderr = std::io::stderr();
        let _ = if self.terminal { write!(stderr, "\r\x1b[2K{line}") } else { writeln!(stderr, "{line}") };
        let _ = stderr.flush();
        self.last = line.to_owned();
    }

    pub(super) fn done(&mut self) {
        if self.terminal && !self.last.is_empty() {
            let _ = writeln!(std::io::stderr());
        }
        self.last.clear();
    }
}

pub(super) struct Client {
    http: reqwest::Client,
    base: String,
    key: Secret,
}

impl Client {
    pub(super) fn new(base: &str, key: &Secret) -> Result<Self, DemoError> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| DemoError::Http { call: "client".into(), message: e.to_string() })?;
        Ok(Self { http, base: base.to_owned(), key: key.clone() })
    }

    pub(super) async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, DemoError> {
        let call = format!("{method} {path}");
        let failed = |message: String| DemoError::Http { call: call.clone(), message };
        let mut request =
            self.http.request(method.clone(), format!("{}{path}", self.base)).bearer_auth(self.key.expose());
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.map_err(|e| failed(e.to_string()))?;
        let status = response.status();
        let text = response.text().await.map_err(|e| failed(e.to_string()))?;
        if !status.is_success() {
            return Err(failed(format!("{status}: {text}")));
        }
        Ok(serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    pub(super) async fn get(&self, path: &str) -> Result<Value, DemoError> {
        self.call(reqwest::Method::GET, path, None).await
    }
}

/// The tail of every agent log, for a failure message: `<id>/agent.log`
/// of the local provider, `<id>.log` of the Docker provider.
pub(super) fn agent_logs(root: &Path) -> String {
    let mut logs = String::new();
    for entry in std::fs::read_dir(root).into_iter().flatten().flatten() {
        let path = entry.path();
        let path = if path.is_dir() { path.join("agent.log") } else { path };
        if let Ok(text) = std::fs::read_to_string(&path) {
            let lines: Vec<&str> = text.lines().collect();
            logs.push_str(&format!(
                "--- {} ---\n{}\n",
                path.display(),
                lines[lines.len().saturating_sub(15)..].join("\n")
            ));
        }
    }
    logs
}
