//! The leader's end of a link: the agents a follower holds become the
//! engine's connections, each with a [`ConnWriter::linked`] writer, so
//! the engine writes their frames down the link as it writes a local
//! socket's. One task per link reads it and alone writes to it.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::Extension;
use axum::extract::State;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade, close_code};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use standby_protocol::Secret;
use tokio::sync::{mpsc, oneshot, watch};

use super::{AgentId, Down, Link, Up, ping_period, silent};
use crate::cluster::Cluster;
use crate::cluster::trust::Forwarded;
use crate::engine::{ConnWriter, EngineHandle, Outbound};
use crate::model::Holder;
use crate::problem::Problem;
use crate::rules::{Admission, AdmissionRefusal, ConnId, Input};

/// How long a new link waits for the replica's older one to free its
/// agents' claims before it is read anyway.
const REPLACE_BOUND: Duration = Duration::from_secs(5);

/// The links open on this leader: one per replica.
#[derive(Debug, Default)]
pub struct Links(std::sync::Mutex<HashMap<String, Registered>>);

#[derive(Debug)]
pub struct Registered {
    generation: u64,
    /// Ends the link; it answers on the sender it is given once its
    /// agents' claims are freed.
    stop: oneshot::Sender<oneshot::Sender<()>>,
}

impl Links {
    /// Registers a new link of `replica`: its stop signal, and the older
    /// link's end to wait for.
    fn replace(
        &self,
        replica: &str,
        generation: u64,
    ) -> (oneshot::Receiver<oneshot::Sender<()>>, Option<oneshot::Receiver<()>>) {
        let (stop, stopped) = oneshot::channel();
        let older = self.0.lock().expect("the links").insert(replica.to_owned(), Registered { generation, stop });
        let freed = older.and_then(|older| {
            let (done, freed) = oneshot::channel();
            older.stop.send(done).ok().map(|()| freed)
        });
        (stopped, freed)
    }

    fn remove(&self, replica: &str, generation: u64) {
        let mut links = self.0.lock().expect("the links");
        if links.get(replica).is_some_and(|link| link.generation == generation) {
            links.remove(replica);
        }
    }
}

/// What the link's route serves with: the engine, and this replica's
/// links.
#[derive(Debug, Clone)]
pub struct LinkRoute {
    pub engine: EngineHandle,
    pub link: Arc<Link>,
}

/// `GET /v1/cluster/link`: a follower's link, upgraded once the middleware
/// checked its token (the [`Forwarded`] extension) and this replica leads
/// at the epoch it was meant for.
pub(crate) async fn link(
    State(LinkRoute { engine, link }): State<LinkRoute>,
    forwarded: Option<Extension<Forwarded>>,
    upgrade: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Response {
    let Some(Extension(by)) = forwarded else {
        return Problem::new(StatusCode::FORBIDDEN, "only a replica of this deployment links to the leader")
            .into_response();
    };
    let upgrade = match upgrade {
        Ok(upgrade) => upgrade,
        Err(rejection) => return Problem::new(StatusCode::BAD_REQUEST, rejection.body_text()).into_response(),
    };
    upgrade.on_upgrade(move |socket| async move {
        let cluster = &link.cluster;
        let generation = cluster.stats.links_accepted.fetch_add(1, Ordering::Relaxed);
        let (stop, older) = link.links.replace(&by.by, generation);
        if let Some(older) = older {
            // Its agents' claims are freed before this link claims them again.
            let _ = tokio::time::timeout(REPLACE_BOUND, older).await;
        }
        tracing::info!(replica = by.by, "a replica linked: it speaks for the agents it holds");
        cluster.stats.linked_replicas.fetch_add(1, Ordering::Relaxed);
        LeaderEnd::new(engine, by.clone(), cluster).run(socket, stop).await;
        cluster.stats.linked_replicas.fetch_sub(1, Ordering::Relaxed);
        link.links.remove(&by.by, generation);
        tracing::info!(replica = by.by, "a replica's link ended: its agents count as disconnected");
    })
}

/// A linked agent, as this leader knows it.
struct Linked {
    conn: ConnId,
    credential_id: String,
    /// What the agent presented, until its socket opens.
    presented: Option<Secret>,
}

/// A claim's answer from the engine: the agent, its connection, the
/// outcome and what it presented.
type Claimed = (AgentId, ConnId, Result<Admission, AdmissionRefusal>, Secret);

/// What the engine writes for a linked agent.
type Framed = (AgentId, Outbound);

struct LeaderEnd {
    engine: EngineHandle,
    /// The replica at the other end, and the epoch it linked at.
    replica: Forwarded,
    ttl: Duration,
    shutdown: watch::Receiver<bool>,
    agents: HashMap<AgentId, Linked>,
    frames: (mpsc::UnboundedSender<Framed>, mpsc::UnboundedReceiver<Framed>),
    claims: (mpsc::UnboundedSender<Claimed>, mpsc::UnboundedReceiver<Claimed>),
}

/// Why a link's loop ended.
enum Ended {
    /// Replaced by a newer link of the replica: tell it once the claims are free.
    Replaced(oneshot::Sender<()>),
    Over,
}

impl LeaderEnd {
    fn new(engine: EngineHandle, replica: Forwarded, cluster: &Cluster) -> Self {
        Self {
            engine,
            replica,
            ttl: cluster.ttl,
            shutdown: cluster.shutdown.clone(),
            agents: HashMap::new(),
            frames: mpsc::unbounded_channel(),
            claims: mpsc::unbounded_channel(),
        }
    }

    async fn run(mut self, mut socket: WebSocket, mut stop: oneshot::Receiver<oneshot::Sender<()>>) {
        let ended = self.serve(&mut socket, &mut stop).await;
        // Every agent of the link is disconnected, the claims still being
        // answered included, before a newer link is read.
        self.claims.1.close();
        while let Ok((_, conn, outcome, _)) = self.claims.1.try_recv() {
            if outcome.is_ok() {
                self.engine.disconnect(conn).await;
            }
        }
        for (_, linked) in self.agents.drain() {
            self.engine.disconnect(linked.conn).await;
        }
        if let Ended::Replaced(freed) = ended {
            let _ = freed.send(());
        }
    }

    async fn serve(&mut self, socket: &mut WebSocket, stop: &mut oneshot::Receiver<oneshot::Sender<()>>) -> Ended {
        let mut heard = Instant::now();
        let mut ping = tokio::time::interval(ping_period(self.ttl));
        let mut shutdown = self.shutdown.clone();
        loop {
            tokio::select! {
                replaced = &mut *stop => {
                    tracing::info!("a newer link of the replica replaces this one");
                    return replaced.map_or(Ended::Over, Ended::Replaced);
                }
                () = super::stopping(&mut shutdown) => {
                    let frame = CloseFrame { code: close_code::RESTART, reason: "the leader is stopping".into() };
                    let _ = socket.send(Message::Close(Some(frame))).await;
                    return Ended::Over;
                }
                _ = ping.tick() => {
                    if silent(heard, Instant::now(), self.ttl) {
                        tracing::warn!(ttl = ?self.ttl, "a replica's link is silent past a lease time: dropped");
                        return Ended::Over;
                    }
                    if socket.send(Message::Ping(Vec::new().into())).await.is_err() {
                        return Ended::Over;
                    }
                }
                incoming = socket.recv() => {
                    heard = Instant::now();
                    match incoming {
                        Some(Ok(Message::Text(text))) => match serde_json::from_str::<Up>(text.as_str()) {
                            Ok(up) => self.up(up).await,
                            Err(error) => {
                                // Never the message itself: a claim carries a credential.
                                let problem = standby_protocol::describe_json_error(&error);
                                tracing::warn!(problem, "a link message that does not parse, skipped");
                            }
                        },
                        None | Some(Err(_)) | Some(Ok(Message::Close(_))) => return Ended::Over,
                        Some(Ok(_)) => {}
                    }
                }
                Some((agent, outbound)) = self.frames.1.recv() => {
                    let down = match outbound {
                        Outbound::Frame { text, assignment_of } => Down::Frame { agent, text, assignment_of },
                        Outbound::Close => Down::Close { agent },
                    };
                    if send(socket, &down).await.is_err() {
                        return Ended::Over;
                    }
                }
                Some((agent, conn, outcome, presented)) = self.claims.1.recv() => {
                    let down = match outcome {
                        Ok(admission) => {
                            let credential_id = admission.credential_id().to_owned();
                            self.agents.insert(agent, Linked { conn, credential_id, presented: Some(presented) });
                            Down::Claimed { agent }
                        }
                        Err(refusal) => Down::Refused { agent, refusal: refusal.into() },
                    };
                    if send(socket, &down).await.is_err() {
                        return Ended::Over;
                    }
                }
            }
        }
    }

    /// Hands a follower's message to the engine.
    async fn up(&mut self, up: Up) {
        match up {
            Up::Claim { agent, token } => {
                // Answered by the engine in its own time: the link reads on.
                let (engine, answers) = (self.engine.clone(), self.claims.0.clone());
                let conn = engine.next_conn_id();
                tokio::spawn(async move {
                    let asked = engine.ask(Input::ClaimSocket { conn, token: token.clone() }).await;
                    let Ok(outcome) = asked else { return };
                    if let Err(unsent) = answers.send((agent, conn, outcome, token))
                        && unsent.0.2.is_ok()
                    {
                        engine.disconnect(conn).await;
                    }
                });
            }
            Up::Open { agent } => {
                let Some(linked) = self.agents.get_mut(&agent) else { return };
                let Some(presented) = linked.presented.take() else { return };
                let writer = ConnWriter::linked(self.frames.0.clone(), agent);
                let holder = Holder { replica: self.replica.by.clone(), epoch: self.replica.epoch };
                self.engine.connect(linked.conn, writer, (&linked.credential_id, presented), Some(holder)).await;
            }
            Up::Heartbeat { agent, state } => {
                if let Some(linked) = self.agents.get(&agent) {
                    self.engine.tell(Input::Heartbeat { conn: linked.conn, state }).await;
                }
            }
            Up::Heard { agents } => {
                let conns: Vec<ConnId> =
                    agents.iter().filter_map(|agent| self.agents.get(agent)).map(|l| l.conn).collect();
                if !conns.is_empty() {
                    self.engine.tell(Input::Heard { conns }).await;
                }
            }
            Up::Sent { agent, run_id } => {
                if self.agents.contains_key(&agent) {
                    self.engine.tell(Input::AssignmentSent { run_id }).await;
                }
            }
            Up::Gone { agent } => {
                if let Some(linked) = self.agents.remove(&agent) {
                    self.engine.disconnect(linked.conn).await;
                }
            }
        }
    }
}

async fn send(socket: &mut WebSocket, down: &Down) -> Result<(), axum::Error> {
    let text = serde_json::to_string(down).expect("a link message serializes");
    socket.send(Message::Text(text.into())).await
}
