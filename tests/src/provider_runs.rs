//! What the provider suites (Docker, Kubernetes) ask of a server whose
//! provider keeps each agent's output in `<data dir>/sandbox-logs`: a run
//! to its end, a thread's turn, a parked sandbox, a ready standby, and the
//! agents' logs when something fails.

use std::time::Duration;

use serde_json::{Value, json};

use crate::server_process::ServerProcess;

/// How long a provider suite waits for any one thing.
pub const WAIT: Duration = Duration::from_secs(60);

/// A provider suite's timings: quick lingering, stopping and heartbeats
/// (a test's own flag wins).
pub const QUICK: [(&str, &str); 3] = [("--linger", "5s"), ("--stop-grace", "3s"), ("--heartbeat-interval", "300ms")];

/// The provider suites' spec: no repository (a sandbox sees no host
/// path), one setup step that counts its runs, so a resumed sandbox shows
/// it was not prepared again.
pub fn counting_spec() -> Value {
    json!({
        "workspace": {
            "repos": [],
            "setup": [{"name": "build", "command": ["sh", "-c", "echo run >> .setup-runs"], "timeout_s": 60}]
        },
        "shell": ["/bin/sh"]
    })
}

impl ServerProcess {
    /// The server's log and the tail of each agent's output, for failures.
    pub fn agent_logs(&self) -> String {
        let mut text = self.logs();
        for entry in std::fs::read_dir(self.data_dir().join("sandbox-logs")).into_iter().flatten().flatten() {
            let log = std::fs::read_to_string(entry.path()).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            text.push_str(&format!("\n--- {} ---\n", entry.path().display()));
            text.push_str(&tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
        }
        text
    }

    /// Runs one run to its end; the run, which exited 0.
    pub async fn run_to_end(&self, body: Value) -> Value {
        let id = self.submit(&body).await;
        let run = self.finished(&id, WAIT).await;
        assert_eq!(
            (run["state"].as_str(), run["exit_code"].as_i64()),
            (Some("exited"), Some(0)),
            "{run}\n{}",
            self.agent_logs()
        );
        run
    }

    /// A turn of `thread`: `sh -c script`, run to its end.
    pub async fn turn(&self, thread: &str, script: &str) -> Value {
        self.run_to_end(json!({"command": ["sh", "-c", script], "thread_id": thread})).await
    }

    /// A run's log, as text.
    pub async fn text_log(&self, run: &Value) -> String {
        String::from_utf8_lossy(&self.log(run["id"].as_str().expect("an id")).await).into_owned()
    }

    /// Waits until the sandbox is parked `mode` and settled.
    pub async fn parked(&self, id: &str, mode: &str) -> Value {
        self.until(&format!("{id} parked {mode}"), WAIT, async || {
            let sandbox = self.sandbox(id).await;
            let settled = match mode {
                "running" => sandbox["last_state"] == "ready" && sandbox["candidate"] == false,
                _ => sandbox["running"] == false,
            };
            (sandbox["state"] == "parked" && sandbox["park"]["mode"] == mode && settled).then_some(sandbox)
        })
        .await
    }

    /// Waits for a ready standby; its sandbox id.
    pub async fn ready_standby(&self) -> String {
        self.until("a ready standby", WAIT, async || {
            self.sandboxes()
                .await
                .into_iter()
                .find(|s| s["candidate"] == true)
                .and_then(|s| s["id"].as_str().map(str::to_owned))
        })
        .await
    }
}

/// The sandbox of a run's last attempt.
pub fn sandbox_of(run: &Value) -> String {
    let attempts = run["attempts"].as_array().expect("attempts");
    attempts.last().and_then(|a| a["sandbox_id"].as_str()).expect("a sandbox").to_owned()
}
