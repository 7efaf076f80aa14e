//! A follower's relay of an agent's control socket, frame by frame, so the
//! agent keeps its socket when the leader goes away: the relay waits for
//! the next leader (from the cluster's `watch`), dials it with the agent's
//! headers and replays the agent's last heartbeat, so the new leader sees
//! the standby ready at once. The agent never notices; a replayed
//! assignment would be ignored by it anyway (its lifecycle's
//! `on_assignment`).
//!
//! The leader is dialled first: a refusal reaches the agent as the leader
//! gave it (status, `Retry-After`, body), and only an admitted socket is
//! upgraded. What to do when the leader's side ends is decided by the
//! pure [`after_upstream`] and [`next_leader`].
//!
//! The relay follows the cluster's view of the leader, not only its two
//! sockets: a leader that is paused or cut off keeps its socket "open"
//! (its kernel takes the frames), so once the view names a leader of a
//! newer epoch the relay drops the old upstream and re-dials, as it does
//! when the old leader's side ends. A leader is dialled only once it
//! proved the cluster secret ([`super::trust`]), within
//! [`super::forward::answer_bound`].

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::extract::FromRequestParts;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade, close_code};
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use futures::{SinkExt, StreamExt};
use standby_protocol::AgentMessage;
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::{self, Message as Upstream};
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use super::forward::{answer_bound, superseded};
use super::trust::{self, Target};
use super::{Cluster, ClusterView, Role};

type Leader = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// How the leader's side of a relayed socket ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// A close frame with this code (`None`: a close frame without one).
    Closed(Option<u16>),
    /// The connection ended without a close frame: the leader died.
    Lost,
}

/// What the relay does about an [`Ending`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Then {
    /// Keep the agent's socket and dial the next leader.
    Redial,
    /// Pass the close to the agent: the leader meant it for the agent.
    PassClose,
}

/// 1012 (service restart): what a leader stopping or deposed sends.
const RESTART: u16 = 1012;

/// A leader that died or restarts is replaced; any other close (a
/// refusal, a retirement, the idle timeout) is the leader's word to the
/// agent.
pub fn after_upstream(ending: Ending) -> Then {
    match ending {
        Ending::Lost | Ending::Closed(Some(RESTART)) => Then::Redial,
        Ending::Closed(_) => Then::PassClose,
    }
}

/// How long a relay keeps an agent's socket without a leader: three lease
/// times (a lapse, an election and a slow claim), then the agent is told
/// 1012 and reconnects on its own.
pub fn wait_bound(ttl: Duration) -> Duration {
    ttl * 3
}

/// What the relay waits for after the leader of `dialled_epoch` went away.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wait {
    /// A newer leader is known: dial it.
    Dial(Target),
    /// Not yet: wait for the next view.
    Pending,
    /// This replica is going away: close the agent's socket.
    GiveUp,
}

/// A leader of a newer epoch than the one dialled (this replica itself
/// included: it then dials its own URL).
pub fn next_leader(view: &ClusterView, dialled_epoch: u64) -> Wait {
    match (&view.role, &view.leader) {
        (Role::Deposed, _) => Wait::GiveUp,
        (_, Some((id, url))) if view.epoch > dialled_epoch => {
            Wait::Dial(Target { id: id.clone(), url: url.clone(), epoch: view.epoch })
        }
        _ => Wait::Pending,
    }
}

/// Dials the leader `target` with the agent's `headers`; admitted, the
/// agent's upgrade is accepted and relayed; refused, the leader's answer
/// is the agent's.
pub async fn socket(cluster: Cluster, target: Target, request: axum::extract::Request) -> Response {
    let (mut parts, _) = request.into_parts();
    let headers = upstream_headers(&parts.headers);
    let epoch = target.epoch;
    // The socket to the leader (one at a time, re-dials included) holds a
    // descriptor for the relay's whole life.
    let Some(slot) = cluster.listener.outgoing() else {
        return super::forward::unavailable("this replica holds all the connections it may: retry");
    };
    let upstream = match dial(&cluster, &target, &headers).await {
        Ok(upstream) => upstream,
        Err(Dial::Refused(response)) => return response,
        Err(Dial::Failed(problem)) => {
            tracing::warn!(leader = target.id, url = target.url, epoch, problem, "relaying a socket failed");
            return super::forward::unavailable("the leader did not answer: retry");
        }
    };
    let upgrade = match WebSocketUpgrade::from_request_parts(&mut parts, &()).await {
        Ok(upgrade) => upgrade,
        Err(rejection) => return rejection.into_response(),
    };
    // Held as the leader holds a direct agent's: small buffers, not the
    // defaults' 128 KiB each way (measured: 292 KiB per relayed socket).
    crate::api_bounds::agent_socket(upgrade).on_upgrade(move |agent| async move {
        cluster.stats.relayed_sockets.fetch_add(1, Ordering::Relaxed);
        // A socket stream each way and a dial: boxed, not on the task's stack.
        let relay = Relay { cluster: cluster.clone(), headers, epoch, heartbeat: None };
        Box::pin(relay.run(agent, upstream)).await;
        cluster.stats.relayed_sockets.fetch_sub(1, Ordering::Relaxed);
        drop(slot);
    })
}

/// The headers a relayed socket re-dials with. They carry the agent's
/// credential, held for the socket's whole life: the value is marked
/// sensitive and `Debug` names the headers only, so no log can print it.
#[derive(Clone)]
struct UpstreamHeaders(HeaderMap);

impl std::fmt::Debug for UpstreamHeaders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.0.keys()).finish()
    }
}

/// The agent's headers but those of its own connection and handshake.
fn upstream_headers(headers: &HeaderMap) -> UpstreamHeaders {
    let mut kept = HeaderMap::new();
    for (name, value) in headers {
        let own = name == header::HOST
            || name == header::CONNECTION
            || name == header::UPGRADE
            || name == header::CONTENT_LENGTH
            || name.as_str().starts_with("sec-websocket-");
        if !own {
            let mut value = value.clone();
            value.set_sensitive(name == header::AUTHORIZATION || value.is_sensitive());
            kept.append(name.clone(), value);
        }
    }
    UpstreamHeaders(kept)
}

enum Dial {
    /// The leader answered the upgrade with another status: the agent's.
    Refused(Response),
    Failed(String),
}

/// Opens a socket on `target`, once it proved the cluster secret, within
/// [`answer_bound`].
async fn dial(cluster: &Cluster, target: &Target, headers: &UpstreamHeaders) -> Result<Leader, Dial> {
    trust::verify(cluster, target).await.map_err(|failure| Dial::Failed(failure.to_string()))?;
    let leader = &target.url;
    let Some(rest) = leader.strip_prefix("http://") else {
        return Err(Dial::Failed(format!("the leader's URL `{leader}` is not http://: only plain HTTP is relayed")));
    };
    let url = format!("ws://{}{}", rest.trim_end_matches('/'), standby_protocol::SOCKET_PATH);
    let mut request = url
        .as_str()
        .into_client_request()
        .map_err(|error| Dial::Failed(format!("the leader's socket URL `{url}` is not usable: {error}")))?;
    request.headers_mut().extend(headers.0.clone());
    let me = cluster.view.borrow().replica_id.clone();
    trust::sign(cluster, &me, target, request.headers_mut());
    let bound = answer_bound(cluster.ttl);
    let connecting =
        tokio_tungstenite::connect_async_with_config(request, Some(crate::api_bounds::leader_socket_config()), true);
    let connected = tokio::time::timeout(bound, connecting)
        .await
        .map_err(|_| Dial::Failed(format!("the leader at {leader} did not answer the upgrade within {bound:?}")))?;
    match connected {
        Ok((socket, _)) => Ok(socket),
        Err(tungstenite::Error::Http(answer)) => {
            let (parts, body) = answer.into_parts();
            let mut response = (parts.status, body.unwrap_or_default()).into_response();
            for name in [header::RETRY_AFTER, header::CONTENT_TYPE] {
                if let Some(value) = parts.headers.get(&name) {
                    response.headers_mut().insert(name, value.clone());
                }
            }
            Err(Dial::Refused(response))
        }
        Err(error) => Err(Dial::Failed(format!("cannot open a socket on the leader at {leader}: {error}"))),
    }
}

/// One relayed socket: this task alone writes to both sides.
struct Relay {
    cluster: Cluster,
    headers: UpstreamHeaders,
    /// The epoch of the leader dialled last.
    epoch: u64,
    /// The agent's last heartbeat frame, replayed to a new leader.
    heartbeat: Option<String>,
}

/// Why a pump ended.
enum Pumped {
    /// The agent's side is over (closed, gone or this replica stopping).
    Done,
    /// The leader's side ended thus.
    Upstream(Ending),
}

impl Relay {
    async fn run(mut self, mut agent: WebSocket, mut upstream: Leader) {
        loop {
            let ending = match self.pump(&mut agent, &mut upstream).await {
                Pumped::Done => return,
                Pumped::Upstream(ending) => ending,
            };
            if let (Then::PassClose, Ending::Closed(code)) = (after_upstream(ending), ending) {
                let frame = code.map(|code| CloseFrame { code, reason: "closed by the leader".into() });
                let _ = agent.send(Message::Close(frame)).await;
                return;
            }
            match self.redial(&mut agent).await {
                Some(next) => upstream = next,
                None => return,
            }
        }
    }

    /// Frames both ways until either side ends, or the view names a newer
    /// leader than the one dialled (the old one may be frozen, its socket
    /// still open: it is dropped, not closed, as a frozen peer would not
    /// read the close).
    async fn pump(&mut self, agent: &mut WebSocket, upstream: &mut Leader) -> Pumped {
        let mut shutdown = self.cluster.shutdown.clone();
        let mut view = self.cluster.view.clone();
        let dialled = self.epoch;
        loop {
            tokio::select! {
                () = superseded(&mut view, dialled) => {
                    tracing::info!(epoch = dialled, "another replica leads now: the relayed socket leaves the former leader");
                    return Pumped::Upstream(Ending::Lost);
                }
                incoming = agent.recv() => match incoming {
                    Some(Ok(Message::Text(text))) => {
                        self.remember(text.as_str());
                        if upstream.send(Upstream::text(text.as_str())).await.is_err() {
                            return Pumped::Upstream(Ending::Lost);
                        }
                    }
                    Some(Ok(Message::Close(_))) | None | Some(Err(_)) => {
                        let _ = upstream.close(None).await;
                        return Pumped::Done;
                    }
                    // Pings are answered by each side's own library.
                    Some(Ok(_)) => {}
                },
                incoming = upstream.next() => match incoming {
                    Some(Ok(Upstream::Text(text))) => {
                        if agent.send(Message::Text(text.as_str().into())).await.is_err() {
                            let _ = upstream.close(None).await;
                            return Pumped::Done;
                        }
                    }
                    Some(Ok(Upstream::Close(frame))) => {
                        return Pumped::Upstream(Ending::Closed(frame.map(|frame| u16::from(frame.code))));
                    }
                    None | Some(Err(_)) => return Pumped::Upstream(Ending::Lost),
                    Some(Ok(_)) => {}
                },
                () = stopping(&mut shutdown) => {
                    let _ = upstream.close(Some(restart_frame("the replica is stopping").into_upstream())).await;
                    let _ = agent.send(Message::Close(Some(restart_frame("the replica is stopping")))).await;
                    return Pumped::Done;
                }
            }
        }
    }

    fn remember(&mut self, text: &str) {
        if matches!(serde_json::from_str::<AgentMessage>(text), Ok(AgentMessage::Heartbeat { .. })) {
            self.heartbeat = Some(text.to_owned());
        }
    }

    /// Waits (within [`wait_bound`]) for a newer leader while the agent's
    /// socket stays open, dials it and replays the last heartbeat; `None`
    /// once the agent's socket was closed (or is gone).
    async fn redial(&mut self, agent: &mut WebSocket) -> Option<Leader> {
        let deadline = tokio::time::Instant::now() + wait_bound(self.cluster.ttl);
        let mut view = self.cluster.view.clone();
        let mut shutdown = self.cluster.shutdown.clone();
        tracing::info!(epoch = self.epoch, "the leader's side of a relayed socket ended: waiting for the next leader");
        loop {
            let wait = next_leader(&view.borrow_and_update(), self.epoch);
            let dialling = matches!(wait, Wait::Dial { .. });
            match wait {
                Wait::GiveUp => break,
                Wait::Dial(target) => match dial(&self.cluster, &target, &self.headers).await {
                    Ok(mut upstream) => {
                        self.epoch = target.epoch;
                        self.cluster.stats.relay_redials.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(
                            epoch = target.epoch,
                            leader = target.id,
                            "a relayed socket re-dialled the new leader"
                        );
                        if let Some(heartbeat) = &self.heartbeat
                            && upstream.send(Upstream::text(heartbeat.as_str())).await.is_err()
                        {
                            continue;
                        }
                        return Some(upstream);
                    }
                    Err(Dial::Refused(response)) => {
                        // The agent reconnects and hears the refusal itself.
                        tracing::info!(status = %response.status(), "the new leader refused a relayed socket");
                        break;
                    }
                    Err(Dial::Failed(problem)) => tracing::debug!(problem, "the new leader is not reachable yet"),
                },
                Wait::Pending => {}
            }
            tokio::select! {
                changed = view.changed() => if changed.is_err() { break },
                // A leader not reachable yet is dialled again.
                () = tokio::time::sleep(Duration::from_millis(250)), if dialling => {}
                () = tokio::time::sleep_until(deadline) => break,
                () = stopping(&mut shutdown) => break,
                incoming = agent.recv() => match incoming {
                    Some(Ok(Message::Text(text))) => self.remember(text.as_str()),
                    Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return None,
                    Some(Ok(_)) => {}
                },
            }
        }
        let _ = agent.send(Message::Close(Some(restart_frame("no leader to relay to")))).await;
        None
    }
}

/// Resolves once the replica stops (holding no borrow of the flag).
async fn stopping(shutdown: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

fn restart_frame(reason: &'static str) -> CloseFrame {
    CloseFrame { code: close_code::RESTART, reason: reason.into() }
}

trait IntoUpstream {
    fn into_upstream(self) -> tungstenite::protocol::CloseFrame;
}

impl IntoUpstream for CloseFrame {
    fn into_upstream(self) -> tungstenite::protocol::CloseFrame {
        tungstenite::protocol::CloseFrame { code: CloseCode::from(self.code), reason: self.reason.as_str().into() }
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    fn view(role: Role, leader: Option<&str>, epoch: u64) -> ClusterView {
        ClusterView {
            replica_id: "r1".into(),
            role,
            leader: leader.map(|url| ("r0".to_owned(), url.to_owned())),
            epoch,
            expires_at: None,
            deadline: None,
        }
    }

    #[test]
    fn a_lost_leader_or_a_restart_is_redialled_any_other_close_passes_to_the_agent() {
        assert_eq!(after_upstream(Ending::Lost), Then::Redial);
        assert_eq!(after_upstream(Ending::Closed(Some(1012))), Then::Redial);
        for code in [None, Some(1000), Some(1008), Some(1011), Some(4001)] {
            assert_eq!(after_upstream(Ending::Closed(code)), Then::PassClose, "{code:?}");
        }
    }

    #[test]
    fn the_relayed_credential_never_prints() {
        let mut agent = HeaderMap::new();
        agent.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer sb_live_hunter2"));
        agent.insert(header::HOST, HeaderValue::from_static("replica-1"));
        let kept = upstream_headers(&agent);
        assert!(kept.0[header::AUTHORIZATION].is_sensitive());
        assert!(!kept.0.contains_key(header::HOST), "the agent's own connection's");
        for printed in [format!("{kept:?}"), format!("{:?}", kept.0)] {
            assert!(!printed.contains("hunter2"), "{printed}");
        }
    }

    #[test]
    fn the_wait_for_a_leader_is_three_lease_times() {
        assert_eq!(wait_bound(Duration::from_secs(3)), Duration::from_secs(9));
    }

    #[test]
    fn only_a_leader_of_a_newer_epoch_is_dialled() {
        assert_eq!(next_leader(&view(Role::Follower, Some("http://a"), 4), 4), Wait::Pending);
        assert_eq!(next_leader(&view(Role::Follower, None, 5), 4), Wait::Pending);
        assert_eq!(next_leader(&view(Role::Candidate, None, 4), 4), Wait::Pending);
        let target = |url: &str, epoch| Wait::Dial(Target { id: "r0".into(), url: url.into(), epoch });
        assert_eq!(next_leader(&view(Role::Follower, Some("http://b"), 5), 4), target("http://b", 5));
        // This replica took the lease: it dials itself.
        assert_eq!(next_leader(&view(Role::Leader, Some("http://me"), 6), 4), target("http://me", 6));
        assert_eq!(next_leader(&view(Role::Deposed, None, 6), 4), Wait::GiveUp);
    }
}
