//! The follower's end of the link: the [`Hub`] of the agents' sockets
//! this replica holds, each served by a task of its own ([`socket`]), and
//! the one task that links to the leader ([`run`]), claims every held
//! agent again on each new link, and routes the leader's frames.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use std::sync::Arc;

use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade, close_code};
use axum::response::Response;
use futures::{SinkExt, StreamExt};
use standby_protocol::{AgentMessage, AgentState, Secret};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::{self, Message as LinkMessage};
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use super::{AgentId, Down, LINK_PATH, Link, Refusal, Up, gather_period, ping_period, silent, wait_bound};
use crate::cluster::forward::{answer_bound, unavailable};
use crate::cluster::trust::{self, Target};
use crate::cluster::{Cluster, Role};
use crate::rules::AdmissionRefusal;

type LinkSocket = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// What a held agent's task is told.
#[derive(Debug)]
enum ToAgent {
    Frame {
        text: String,
        assignment_of: Option<String>,
    },
    Close,
    /// Close with 1012: the agent reconnects (and hears a refusal itself).
    Restart(&'static str),
}

/// The leader's answer to an agent's first claim.
type ClaimAnswer = oneshot::Receiver<Result<(), Refusal>>;

/// One agent socket this replica holds.
struct Held {
    token: Secret,
    to_agent: mpsc::UnboundedSender<ToAgent>,
    /// What the agent reported last, and what the current link was told.
    state: Option<AgentState>,
    reported: Option<AgentState>,
    /// The link its claim was answered on, and whether it is open there.
    claimed_on: Option<u64>,
    open: bool,
    /// The upgrade waiting for the first claim's answer.
    answer: Option<oneshot::Sender<Result<(), Refusal>>>,
}

#[derive(Default)]
struct HubState {
    agents: HashMap<AgentId, Held>,
    /// The current link, and its number.
    link: Option<mpsc::UnboundedSender<Up>>,
    generation: u64,
    /// Agents whose routine heartbeat came since the last gathering.
    heard: Vec<AgentId>,
}

impl HubState {
    fn up(&self, up: Up) {
        if let Some(link) = &self.link {
            let _ = link.send(up);
        }
    }

    /// Opens the agent on the current link, with the state it reported
    /// last (so a new leader sees a ready standby ready at once).
    fn open(&mut self, agent: AgentId) {
        let Some(held) = self.agents.get_mut(&agent) else { return };
        held.open = true;
        held.reported = held.state;
        let report = held.state;
        self.up(Up::Open { agent });
        if let Some(report) = report {
            self.up(Up::Heartbeat { agent, state: report });
        }
    }
}

/// The agents' sockets this replica holds, and what the link knows of
/// them. Held under a lock for a few map operations at a time.
pub struct Hub {
    state: Mutex<HubState>,
    next_agent: AtomicU64,
    /// A held socket silent for this long is closed (as the leader closes
    /// its own).
    idle_timeout: Duration,
    heartbeat_interval: Duration,
}

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub").field("held", &self.held()).finish_non_exhaustive()
    }
}

impl Hub {
    pub fn new(idle_timeout: Duration, heartbeat_interval: Duration) -> Self {
        Self { state: Mutex::default(), next_agent: AtomicU64::new(1), idle_timeout, heartbeat_interval }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HubState> {
        self.state.lock().expect("the hub")
    }

    /// The agents' sockets held now (`/metrics`).
    pub fn held(&self) -> usize {
        self.lock().agents.len()
    }

    /// Registers an agent presenting `token` and sends its claim, when a
    /// link is up: its number, its task's queue and the claim's answer.
    fn claim(&self, token: Secret) -> Option<(AgentId, mpsc::UnboundedReceiver<ToAgent>, ClaimAnswer)> {
        let mut state = self.lock();
        state.link.as_ref()?;
        let agent = self.next_agent.fetch_add(1, Ordering::Relaxed);
        let (to_agent, queue) = mpsc::unbounded_channel();
        let (answer, answered) = oneshot::channel();
        state.up(Up::Claim { agent, token: token.clone() });
        let held =
            Held { token, to_agent, state: None, reported: None, claimed_on: None, open: false, answer: Some(answer) };
        state.agents.insert(agent, held);
        Some((agent, queue, answered))
    }

    /// The agent's socket is upgraded: opened on the link its claim was
    /// answered on (a claim answered on an older link is made again by the
    /// newer one).
    fn opened(&self, agent: AgentId) {
        let mut state = self.lock();
        let generation = state.generation;
        let linked = state.link.is_some();
        let Some(held) = state.agents.get_mut(&agent) else { return };
        if linked && held.claimed_on == Some(generation) && !held.open {
            state.open(agent);
        }
    }

    /// A heartbeat of the agent: sent up when its state changed, else
    /// gathered.
    fn heartbeat(&self, agent: AgentId, report: AgentState) {
        let mut state = self.lock();
        let Some(held) = state.agents.get_mut(&agent) else { return };
        held.state = Some(report);
        if !held.open {
            return;
        }
        if held.reported == Some(report) {
            state.heard.push(agent);
        } else {
            held.reported = Some(report);
            state.up(Up::Heartbeat { agent, state: report });
        }
    }

    fn sent(&self, agent: AgentId, run_id: String) {
        let state = self.lock();
        if state.agents.get(&agent).is_some_and(|held| held.open) {
            state.up(Up::Sent { agent, run_id });
        }
    }

    /// The agent's socket is closed, or its upgrade was given up.
    fn gone(&self, agent: AgentId) {
        let mut state = self.lock();
        if let Some(held) = state.agents.remove(&agent)
            && held.claimed_on.is_some()
        {
            state.up(Up::Gone { agent });
        }
    }

    /// A new link, `link`: every upgraded agent is claimed on it again.
    fn link_up(&self, link: mpsc::UnboundedSender<Up>) -> u64 {
        let mut state = self.lock();
        state.generation += 1;
        state.heard.clear();
        for (&agent, held) in &mut state.agents {
            (held.claimed_on, held.open, held.reported) = (None, false, None);
            if held.answer.is_none() {
                let _ = link.send(Up::Claim { agent, token: held.token.clone() });
            }
        }
        state.link = Some(link);
        state.generation
    }

    /// The link is gone: the claims waiting on it fail (`503`), and what
    /// the agents report waits for the next one.
    fn link_down(&self) {
        let mut state = self.lock();
        state.link = None;
        state.heard.clear();
        state.agents.retain(|_, held| {
            (held.claimed_on, held.open, held.reported) = (None, false, None);
            held.answer.take().is_none()
        });
    }

    /// Routine heartbeats gathered since the last call.
    fn gathered(&self) -> Vec<AgentId> {
        std::mem::take(&mut self.lock().heard)
    }

    /// The leader's message for an agent, on link `generation`.
    fn down(&self, generation: u64, down: Down) {
        let mut state = self.lock();
        if state.generation != generation {
            return;
        }
        let agent = match &down {
            Down::Claimed { agent }
            | Down::Refused { agent, .. }
            | Down::Frame { agent, .. }
            | Down::Close { agent } => *agent,
        };
        let Some(held) = state.agents.get_mut(&agent) else {
            // Gone meanwhile: the leader frees what it claimed for it.
            if matches!(down, Down::Claimed { .. }) {
                state.up(Up::Gone { agent });
            }
            return;
        };
        match down {
            Down::Claimed { .. } => {
                held.claimed_on = Some(generation);
                if let Some(answer) = held.answer.take() {
                    let _ = answer.send(Ok(()));
                    return;
                }
                // Claimed again on a new link: open at once.
                state.open(agent);
            }
            Down::Refused { refusal, .. } => match held.answer.take() {
                Some(answer) => {
                    let _ = answer.send(Err(refusal));
                }
                None => {
                    tracing::info!(agent, ?refusal, "the leader refused a held agent's socket: it reconnects");
                    let _ = held.to_agent.send(ToAgent::Restart("refused by the leader: reconnect"));
                }
            },
            Down::Frame { text, assignment_of, .. } => {
                let _ = held.to_agent.send(ToAgent::Frame { text, assignment_of });
            }
            Down::Close { .. } => {
                let _ = held.to_agent.send(ToAgent::Close);
            }
        }
    }

    /// Tells every held agent to reconnect (no leader for too long, or
    /// this replica stopping).
    fn restart_all(&self, reason: &'static str) {
        let state = self.lock();
        for held in state.agents.values() {
            let _ = held.to_agent.send(ToAgent::Restart(reason));
        }
    }
}

/// An agent's upgrade on a follower, presenting `token` (already checked
/// for its form, under the upgrade bound): its credential's socket is
/// claimed over the link, and once the leader admits it the socket is held
/// here. A refusal is the leader's, for the caller to answer as the leader
/// would.
pub async fn socket(link: Arc<Link>, token: Secret, upgrade: WebSocketUpgrade) -> Result<Response, AdmissionRefusal> {
    let Some((agent, queue, answered)) = link.hub.claim(token) else {
        return Ok(unavailable("no leader is reachable right now: retry"));
    };
    // From here until its task holds it, the agent's place is freed on any
    // way out (a refusal, no answer, an upgrade that never completes).
    let mut unfinished = Unfinished { link: Some(Arc::clone(&link)), agent };
    match tokio::time::timeout(answer_bound(link.cluster.ttl), answered).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(refusal))) => return Err(refusal.into()),
        Ok(Err(_)) | Err(_) => return Ok(unavailable("the leader did not answer: retry")),
    }
    Ok(crate::api_bounds::agent_socket(upgrade).on_upgrade(move |socket| async move {
        let Some(link) = unfinished.link.take() else { return };
        link.cluster.stats.held_agents.fetch_add(1, Ordering::Relaxed);
        hold(&link.hub, agent, socket, queue).await;
        link.hub.gone(agent);
        link.cluster.stats.held_agents.fetch_sub(1, Ordering::Relaxed);
    }))
}

/// Frees the agent's place when the upgrade is dropped unfinished.
struct Unfinished {
    link: Option<Arc<Link>>,
    agent: AgentId,
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        if let Some(link) = self.link.take() {
            link.hub.gone(self.agent);
        }
    }
}

/// One held socket: this task alone reads and writes it.
async fn hold(hub: &Hub, agent: AgentId, mut socket: WebSocket, mut queue: mpsc::UnboundedReceiver<ToAgent>) {
    hub.opened(agent);
    let idle = tokio::time::sleep(hub.idle_timeout);
    tokio::pin!(idle);
    loop {
        tokio::select! {
            () = &mut idle => {
                tracing::info!(agent, "a held control socket silent past the idle timeout: closed");
                return;
            }
            incoming = socket.recv() => match incoming {
                None | Some(Err(_)) | Some(Ok(Message::Close(_))) => return,
                Some(Ok(Message::Text(text))) => {
                    idle.as_mut().reset(tokio::time::Instant::now() + hub.idle_timeout);
                    if let Ok(AgentMessage::Heartbeat { state, .. }) = serde_json::from_str(text.as_str()) {
                        hub.heartbeat(agent, state);
                    }
                }
                Some(Ok(_)) => {}
            },
            told = queue.recv() => match told {
                Some(ToAgent::Frame { text, assignment_of }) => {
                    if socket.send(Message::Text(text.into())).await.is_err() {
                        return;
                    }
                    if let Some(run_id) = assignment_of {
                        hub.sent(agent, run_id);
                    }
                }
                Some(ToAgent::Close) => {
                    let _ = socket.send(Message::Close(None)).await;
                    return;
                }
                Some(ToAgent::Restart(reason)) => {
                    let frame = CloseFrame { code: close_code::RESTART, reason: reason.into() };
                    let _ = socket.send(Message::Close(Some(frame))).await;
                    return;
                }
                // Dropped from the hub: nobody speaks for it any more.
                None => return,
            },
        }
    }
}

/// Dials `target` (once it proved the cluster secret) for this replica's
/// link, within [`answer_bound`].
async fn dial(cluster: &Cluster, target: &Target) -> Result<LinkSocket, String> {
    trust::verify(cluster, target).await.map_err(|failure| failure.to_string())?;
    let leader = &target.url;
    let Some(rest) = leader.strip_prefix("http://") else {
        return Err(format!("the leader's URL `{leader}` is not http://: only plain HTTP links"));
    };
    let url = format!("ws://{}{LINK_PATH}", rest.trim_end_matches('/'));
    let mut request =
        url.as_str().into_client_request().map_err(|error| format!("the link URL `{url}` is not usable: {error}"))?;
    let me = cluster.view.borrow().replica_id.clone();
    trust::sign(cluster, &me, target, request.headers_mut());
    let bound = answer_bound(cluster.ttl);
    let connecting = tokio_tungstenite::connect_async(request);
    match tokio::time::timeout(bound, connecting).await {
        Err(_) => Err(format!("the leader at {leader} did not answer the link's upgrade within {bound:?}")),
        Ok(Err(tungstenite::Error::Http(answer))) => {
            Err(format!("the leader at {leader} refused the link: {}", answer.status()))
        }
        Ok(Err(error)) => Err(format!("cannot link to the leader at {leader}: {error}")),
        Ok(Ok((socket, _))) => Ok(socket),
    }
}

/// This replica's link to whoever leads (itself included), for as long as
/// it runs: a new link once the last one ended, every held agent claimed
/// again on it; the agents told to reconnect after [`wait_bound`] without
/// a link, and when the replica stops.
pub async fn run(link: Arc<Link>) {
    let (cluster, hub) = (&link.cluster, &link.hub);
    let mut view = cluster.view.clone();
    let mut shutdown = cluster.shutdown.clone();
    let mut unlinked_since = Instant::now();
    let mut linked_before = false;
    loop {
        if *shutdown.borrow() {
            break;
        }
        let now = view.borrow_and_update().clone();
        if now.role == Role::Deposed {
            break;
        }
        // The link holds a descriptor under the cap, as a forwarded call does.
        let slot = cluster.listener.outgoing();
        if let (Some((id, url)), Some(_slot)) = (now.leader.clone(), slot) {
            let target = Target { id, url, epoch: now.epoch };
            match dial(cluster, &target).await {
                Ok(socket) => {
                    if linked_before {
                        cluster.stats.relinks.fetch_add(1, Ordering::Relaxed);
                    }
                    linked_before = true;
                    tracing::info!(leader = target.id, epoch = target.epoch, held = hub.held(), "linked to the leader");
                    serve(&link, socket, &target).await;
                    tracing::info!(leader = target.id, epoch = target.epoch, "the link to the leader ended");
                    unlinked_since = Instant::now();
                }
                Err(problem) => tracing::debug!(problem, "cannot link to the leader yet"),
            }
        }
        if unlinked_since.elapsed() > wait_bound(cluster.ttl) && hub.held() > 0 {
            tracing::warn!(held = hub.held(), "no leader to link to: the held agents reconnect");
            hub.restart_all("no leader to link to");
            unlinked_since = Instant::now();
        }
        tokio::select! {
            _ = view.changed() => {}
            () = tokio::time::sleep(Duration::from_millis(250)) => {}
            () = super::stopping(&mut shutdown) => break,
        }
    }
    hub.restart_all("the replica is stopping");
}

/// One link, until it ends: claims every held agent again, sends what the
/// hub queues and the heartbeats it gathered, routes the leader's frames.
async fn serve(link: &Link, mut socket: LinkSocket, target: &Target) {
    let (cluster, hub) = (&link.cluster, &link.hub);
    let (up, mut queued) = mpsc::unbounded_channel();
    let generation = hub.link_up(up);
    let mut heard = Instant::now();
    let mut ping = tokio::time::interval(ping_period(cluster.ttl));
    let mut gather = tokio::time::interval(gather_period(hub.heartbeat_interval));
    let (mut view, mut shutdown) = (cluster.view.clone(), cluster.shutdown.clone());
    loop {
        tokio::select! {
            () = moved(&mut view, target) => {
                tracing::info!(epoch = target.epoch, "the view names another leader now: the link moves to it");
                break;
            }
            () = super::stopping(&mut shutdown) => {
                let frame = tungstenite::protocol::CloseFrame { code: CloseCode::Restart, reason: "the replica is stopping".into() };
                let _ = socket.close(Some(frame)).await;
                break;
            }
            _ = ping.tick() => {
                if silent(heard, Instant::now(), cluster.ttl) {
                    tracing::warn!(leader = target.id, "the link is silent past a lease time: dropped");
                    break;
                }
                if socket.send(LinkMessage::Ping(Vec::new().into())).await.is_err() {
                    break;
                }
            }
            _ = gather.tick() => {
                let agents = hub.gathered();
                if !agents.is_empty() && send(&mut socket, &Up::Heard { agents }).await.is_err() {
                    break;
                }
            }
            Some(message) = queued.recv() => {
                if send(&mut socket, &message).await.is_err() {
                    break;
                }
            }
            incoming = socket.next() => {
                // Read after a silence the leader has dropped the link for:
                // nothing of it is acted on (this replica may have been
                // paused; the leader moved on without it).
                if silent(heard, Instant::now(), cluster.ttl) {
                    tracing::warn!(leader = target.id, "the link was silent past a lease time: what it carried is dropped");
                    break;
                }
                heard = Instant::now();
                match incoming {
                    Some(Ok(LinkMessage::Text(text))) => match serde_json::from_str::<Down>(text.as_str()) {
                        Ok(down) => hub.down(generation, down),
                        Err(error) => {
                            let problem = standby_protocol::describe_json_error(&error);
                            tracing::warn!(problem, "a link message that does not parse, skipped");
                        }
                    },
                    None | Some(Err(_)) | Some(Ok(LinkMessage::Close(_))) => break,
                    Some(Ok(_)) => {}
                }
            }
        }
    }
    hub.link_down();
}

/// Resolves once the view names another leader than `target` (another
/// epoch, replica or URL): a link follows the view, as forwarded calls do.
async fn moved(view: &mut tokio::sync::watch::Receiver<crate::cluster::ClusterView>, target: &Target) {
    let named = |view: &crate::cluster::ClusterView| {
        view.epoch == target.epoch
            && view.leader.as_ref().is_some_and(|(id, url)| *id == target.id && *url == target.url)
    };
    let _ = view.wait_for(|view| !named(view)).await;
}

async fn send(socket: &mut LinkSocket, up: &Up) -> Result<(), tungstenite::Error> {
    let text = serde_json::to_string(up).expect("a link message serializes");
    socket.send(LinkMessage::text(text)).await
}
