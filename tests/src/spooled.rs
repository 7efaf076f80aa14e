//! A `standby-server` on `--provider spool`: its sandboxes are credential
//! files, and the test plays each sandbox itself (the control socket, the
//! agent's calls), so it sees and can replay every credential it is handed.
//! For tests of the server's rules and of hostile agents.

use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use nix::sys::signal::Signal;
use serde_json::Value;
use standby_protocol::{AgentMessage, AgentState, PROTOCOL_HEADER, PROTOCOL_VERSION, ServerMessage};
use tempfile::TempDir;
use tokio_tungstenite::tungstenite::Message;

use crate::server_process::{ControlSocket, ServerProcess};
use crate::server_process::{ServerBuilder, keygen};

/// How long a spooled test waits for anything.
pub const WAIT: Duration = Duration::from_secs(60);

/// A server whose sandboxes are credential files: the test plays each
/// sandbox itself and sees every credential it is handed.
#[derive(Debug)]
pub struct Spooled {
    pub dir: TempDir,
    pub spool: PathBuf,
    pub server: ServerProcess,
    /// A PostgreSQL store's URL; `None`: the default SQLite file.
    store: Option<String>,
}

/// A spooled server with `pool` standbys that heartbeat every 10 s.
pub async fn spooled(pool: usize) -> Spooled {
    spooled_with(pool, "10s").await
}

/// A spooled server whose agents are told to heartbeat every `heartbeat`.
pub async fn spooled_with(pool: usize, heartbeat: &str) -> Spooled {
    spooled_on(None, pool, heartbeat).await
}

/// A spooled server on `store` (a PostgreSQL URL; `None`: SQLite).
pub async fn spooled_on(store: Option<String>, pool: usize, heartbeat: &str) -> Spooled {
    let dir = tempfile::Builder::new().prefix("standby-spooled-").tempdir().expect("a temp dir");
    let spool = dir.path().join("spool");
    let server = spooled_server(&dir, &spool, store.as_deref(), pool, heartbeat).await;
    Spooled { dir, spool, server, store }
}

pub async fn spooled_server(
    dir: &TempDir,
    spool: &Path,
    store: Option<&str>,
    pool: usize,
    heartbeat: &str,
) -> ServerProcess {
    let name = dir.path().file_name().map(|name| name.to_string_lossy().into_owned()).unwrap_or_default();
    let mut builder = ServerBuilder::new(&dir.path().join("data"), &dir.path().join("server.log"), &name)
        .args(&["--provider", "spool", "--spool-dir", &spool.display().to_string()])
        .args(&["--pool-size", &pool.to_string(), "--heartbeat-interval", heartbeat, "--launch-timeout", "1h"])
        .args(&["--linger", "1s", "--max-attempts", "3"]);
    if let Some(store) = store {
        // A server on PostgreSQL never generates its sealing key.
        let key = dir.path().join("secret.key");
        if !key.exists() {
            keygen(&key);
        }
        builder = builder
            .args(&["--store", store, "--secret-key-file", &key.display().to_string()])
            .cluster_secret(&dir.path().join("cluster.secret"));
    }
    builder.start().await
}

impl Spooled {
    /// Stops the server (SIGTERM) and starts it again on the same store.
    pub async fn restart(self, pool: usize, heartbeat: &str) -> Self {
        let Self { dir, spool, server, store } = self;
        let status = server.stop(Signal::SIGTERM).await;
        assert!(status.success(), "standby-server exited {status} on SIGTERM");
        let server = spooled_server(&dir, &spool, store.as_deref(), pool, heartbeat).await;
        Self { dir, spool, server, store }
    }

    /// The standby credential of `sandbox_id`, once spooled.
    pub async fn token_of(&self, sandbox_id: &str) -> String {
        let path = self.spool.join(format!("{sandbox_id}.token"));
        self.server
            .until(&format!("the credential of {sandbox_id}"), WAIT, async || {
                std::fs::read_to_string(&path).ok().map(|token| token.trim().to_owned())
            })
            .await
    }

    /// A spooled standby credential other than `known` (a sandbox the pool
    /// made since).
    pub async fn new_token(&self, known: &[String]) -> String {
        self.server
            .until("a new spooled standby credential", WAIT, async || {
                self.spooled_now().into_iter().find(|token| !known.contains(token))
            })
            .await
    }

    pub fn spooled_now(&self) -> Vec<String> {
        std::fs::read_dir(&self.spool)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|entry| entry.path().extension().is_some_and(|ext| ext == "token"))
            .filter_map(|entry| std::fs::read_to_string(entry.path()).ok())
            .map(|token| token.trim().to_owned())
            .collect()
    }

    /// The standby credentials spooled so far (at least `n`), oldest first.
    pub async fn tokens(&self, n: usize) -> Vec<String> {
        self.server
            .until(&format!("{n} spooled standby credentials"), WAIT, async || {
                let mut tokens: Vec<(std::time::SystemTime, String)> = std::fs::read_dir(&self.spool)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .filter(|entry| entry.path().extension().is_some_and(|ext| ext == "token"))
                    .filter_map(|entry| {
                        let modified = entry.metadata().ok()?.modified().ok()?;
                        Some((modified, std::fs::read_to_string(entry.path()).ok()?.trim().to_owned()))
                    })
                    .collect();
                tokens.sort();
                (tokens.len() >= n).then(|| tokens.into_iter().map(|(_, token)| token).collect())
            })
            .await
    }

    /// A standby connection saying `ready`, as a prepared agent's would,
    /// once the server counts it as a candidate. (The heartbeat interval
    /// is long: one heartbeat keeps it a candidate for the whole test.)
    pub async fn ready_standby(&self, token: &str) -> Socket {
        let before = self.candidates().await;
        let mut socket =
            self.server.upgrade(token).await.unwrap_or_else(|status| panic!("standby refused with {status}"));
        socket.send(heartbeat(AgentState::Ready, None)).await.expect("send a heartbeat");
        self.server
            .until("the standby to be a candidate", WAIT, async || (self.candidates().await > before).then_some(()))
            .await;
        socket
    }

    pub async fn candidates(&self) -> usize {
        self.server.sandboxes().await.iter().filter(|sandbox| sandbox["candidate"] == true).count()
    }

    /// A call of the agent-facing API with `credential`.
    pub async fn agent_call(
        &self,
        method: reqwest::Method,
        path: &str,
        credential: &str,
        body: Option<&str>,
    ) -> (u16, Value) {
        let mut request = reqwest::Client::new()
            .request(method, format!("{}{path}", self.server.url()))
            .bearer_auth(credential)
            .header(PROTOCOL_HEADER, PROTOCOL_VERSION);
        if let Some(body) = body {
            request = request.header("Content-Type", "application/json").body(body.to_owned());
        }
        let response = request.send().await.expect("the server answers");
        let status = response.status().as_u16();
        let text = response.text().await.expect("a body");
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    /// Submits a run and reads its assignment on `socket`: the execution
    /// id and the run credential.
    pub async fn assigned(&self, socket: &mut Socket, run: &Value) -> (String, String) {
        let id = self.server.submit(run).await;
        let (execution_id, credential) = next_assignment(socket).await;
        assert_eq!(execution_id, id, "the assignment is for the run just submitted");
        (execution_id, credential)
    }

    /// Submits `run` while two standbys wait: the assignment, from
    /// whichever of them the server chose.
    pub async fn assigned_either(&self, a: &mut Socket, b: &mut Socket, run: &Value) -> (String, String) {
        let id = self.server.submit(run).await;
        let got = tokio::select! {
            got = next_assignment(a) => got,
            got = next_assignment(b) => got,
        };
        assert_eq!(got.0, id, "the assignment is for the run just submitted");
        got
    }

    pub async fn stop(self) -> TempDir {
        let status = self.server.stop(Signal::SIGTERM).await;
        assert!(status.success(), "standby-server exited {status} on SIGTERM");
        self.dir
    }
}

pub type Socket = ControlSocket;

pub fn heartbeat(state: AgentState, execution_id: Option<&str>) -> Message {
    Message::text(AgentMessage::Heartbeat { state, execution_id: execution_id.map(str::to_owned) }.encode())
}

pub async fn next_assignment(socket: &mut Socket) -> (String, String) {
    let assignment = next_assignment_frame(socket).await;
    (assignment.execution_id, assignment.run_credential.expose().to_owned())
}

pub async fn next_assignment_frame(socket: &mut Socket) -> standby_protocol::Assignment {
    let read = async {
        while let Some(frame) = socket.next().await {
            if let Ok(Message::Text(text)) = frame
                && let Ok(ServerMessage::Assignment(assignment)) = ServerMessage::decode(text.as_str())
            {
                return *assignment;
            }
        }
        panic!("the connection closed before an assignment")
    };
    tokio::time::timeout(WAIT, read).await.expect("an assignment within the wait")
}

/// Reads `socket` until the server closes it; panics on any assignment.
pub async fn closed_by_server(socket: &mut Socket) {
    let read = async {
        while let Some(frame) = socket.next().await {
            match frame {
                Ok(Message::Close(_)) | Err(_) => return,
                Ok(Message::Text(text)) => {
                    assert!(
                        !matches!(ServerMessage::decode(text.as_str()), Ok(ServerMessage::Assignment(_))),
                        "an assignment on a socket the server is closing: {text}"
                    );
                }
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(WAIT, read).await.expect("the server closes the socket within the wait");
}
