//! What the replicated tests (`replicas.rs`, `soak_replicas.rs`) put in
//! front of and behind `standby-server serve` replicas sharing one store:
//! a [`Balancer`] spreading TCP connections over them, and
//! [`SpooledAgents`], real `standby` agents started by the test for every
//! standby credential the leader spools (the `spool` provider launches
//! nothing), so that agents outlive any replica that is killed.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

use crate::harness::{AgentBuilder, AgentProcess};

/// A TCP balancer on 127.0.0.1: each connection goes to the next replica
/// that accepts it (a dead one is skipped), as a load balancer would.
#[derive(Debug)]
pub struct Balancer {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
    targets: Arc<Mutex<Vec<SocketAddr>>>,
}

impl Balancer {
    /// Round robin over `targets`.
    pub async fn start(targets: Vec<SocketAddr>) -> Self {
        Self::spread(targets, true).await
    }

    /// Always the first of `targets` that accepts: a test decides which
    /// replica its agents reach, and where they go when it is gone.
    pub async fn failover(targets: Vec<SocketAddr>) -> Self {
        Self::spread(targets, false).await
    }

    /// From now on, only `targets` (as a balancer's health check would
    /// take a replica out of its pool).
    pub fn set_targets(&self, targets: Vec<SocketAddr>) {
        *self.targets.lock().unwrap_or_else(PoisonError::into_inner) = targets;
    }

    async fn spread(targets: Vec<SocketAddr>, round_robin: bool) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the balancer");
        let addr = listener.local_addr().expect("an address");
        let next = Arc::new(AtomicUsize::new(0));
        let targets = Arc::new(Mutex::new(targets));
        let pool = Arc::clone(&targets);
        let task = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let targets = pool.lock().unwrap_or_else(PoisonError::into_inner).clone();
                let next = Arc::clone(&next);
                tokio::spawn(async move {
                    for tried in 0..targets.len() {
                        let at = if round_robin { next.fetch_add(1, Ordering::Relaxed) } else { tried };
                        let target = targets[at % targets.len()];
                        let connect = tokio::time::timeout(Duration::from_secs(1), TcpStream::connect(target)).await;
                        if let Ok(Ok(mut server)) = connect {
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                            return;
                        }
                    }
                });
            }
        });
        Self { addr, task, targets }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Balancer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The agents started so far, by sandbox id (the spooled file's stem), in
/// the order they were started.
type Started = Arc<Mutex<Vec<(String, AgentProcess)>>>;

/// Starts an agent for each credential the leader spools, dialing the URL
/// given (or the one a test pins, once it set one); keeps them until
/// dropped.
#[derive(Debug)]
pub struct SpooledAgents {
    task: tokio::task::JoinHandle<()>,
    started: Started,
    url: Arc<Mutex<Option<String>>>,
}

impl SpooledAgents {
    /// Agents heartbeating every `heartbeat` (an agent flag value).
    pub fn start(spool: PathBuf, server_url: Option<String>, heartbeat: &str) -> Self {
        let started: Started = Arc::new(Mutex::new(Vec::new()));
        let url = Arc::new(Mutex::new(server_url));
        let (agents, pinned, heartbeat) = (Arc::clone(&started), Arc::clone(&url), heartbeat.to_owned());
        let task = tokio::spawn(async move {
            let mut seen = HashSet::new();
            loop {
                let server_url = pinned.lock().unwrap_or_else(PoisonError::into_inner).clone();
                for entry in std::fs::read_dir(&spool).into_iter().flatten().flatten() {
                    let Some(server_url) = &server_url else { break };
                    let path = entry.path();
                    if path.extension().is_none_or(|ext| ext != "token") || !seen.insert(path.clone()) {
                        continue;
                    }
                    let Ok(token) = std::fs::read_to_string(&path) else { continue };
                    let sandbox = path.file_stem().map(|stem| stem.to_string_lossy().into_owned()).unwrap_or_default();
                    let agent = AgentBuilder::new(server_url, token.trim()).heartbeat_interval(&heartbeat).spawn();
                    agents.lock().unwrap_or_else(PoisonError::into_inner).push((sandbox, agent));
                }
                // The spool is files another process writes: polled.
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        Self { task, started, url }
    }

    /// The agents started from now on dial `url`.
    pub fn pin(&self, url: &str) {
        *self.url.lock().unwrap_or_else(PoisonError::into_inner) = Some(url.to_owned());
    }

    /// The output of the first agent started, once there is one.
    pub fn first_output(&self) -> Option<String> {
        self.started.lock().unwrap_or_else(PoisonError::into_inner).first().map(|(_, agent)| agent.output())
    }

    /// Every agent's sandbox and output, in the order they were started.
    pub fn outputs(&self) -> Vec<(String, String)> {
        let started = self.started.lock().unwrap_or_else(PoisonError::into_inner);
        started.iter().map(|(sandbox, agent)| (sandbox.clone(), agent.output())).collect()
    }

    /// The pid of the agent holding sandbox `id`'s credential, once started.
    pub fn pid(&self, sandbox: &str) -> Option<i32> {
        let started = self.started.lock().unwrap_or_else(PoisonError::into_inner);
        started.iter().find(|(id, _)| id == sandbox).map(|(_, agent)| agent.pid())
    }

    /// How many agents were started.
    pub fn count(&self) -> usize {
        self.started.lock().unwrap_or_else(PoisonError::into_inner).len()
    }
}

impl Drop for SpooledAgents {
    fn drop(&mut self) {
        self.task.abort();
        self.started.lock().unwrap_or_else(PoisonError::into_inner).clear();
    }
}

/// `POST /v1/runs` of `body` to the replica at `url` under `key`, once:
/// the new run's id on `201`, `None` on any other answer or none (a
/// replica in an election answers `503`; the caller tries again with the
/// same key).
pub async fn submit_once(url: &str, key: &str, body: &serde_json::Value) -> Option<String> {
    let response = reqwest::Client::new()
        .post(format!("{url}/v1/runs"))
        .bearer_auth(crate::server_process::API_KEY)
        .header("Idempotency-Key", key)
        .json(body)
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .ok()
        .filter(|response| response.status().as_u16() == 201)?;
    let created = response.json::<serde_json::Value>().await.ok()?;
    created["id"].as_str().map(str::to_owned)
}
