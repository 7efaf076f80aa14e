//! The agents' link: a follower holds the control sockets its agents
//! opened and speaks for all of them to the leader over one WebSocket of
//! its own ([`LINK_PATH`]). The leader holds one socket per replica, not
//! one per agent, so each replica's open-files cap counts its own agents
//! only; and a follower's agents keep their sockets when the leader
//! changes: the follower links to the next one and claims them again.
//!
//! Up the link ([`Up`]) go what the leader's rules need of an agent: the
//! claim of its credential's socket, its opening, a heartbeat whose state
//! changed, the routine heartbeats gathered ([`Up::Heard`], once per
//! [`gather_period`]: the leader never parses an agent's routine frame),
//! an assignment written, the socket gone. Down ([`Down`]) come the
//! claim's answer and the frames and closes the leader's engine writes,
//! each after its commit (commit before tell holds across the link).
//!
//! A link is one connection to one leader of one epoch. Both ends drop it
//! once it is silent for a lease time ([`silent`]); the follower also when
//! the view names a newer leader. What a dropped link carried is not
//! acted on: the leader counts every agent of it disconnected (an
//! unconfirmed assignment is then replayed when the agent is claimed
//! again, or requeued once its sandbox is silent, by the contract's
//! rules); the follower writes no frame that it read after the link went
//! silent, so a follower paused past its lease sends nothing stale when
//! it wakes. A replica links once: the leader drops a replica's older
//! link, and frees its agents' claims, before it reads the new one.
//!
//! The link is authenticated as forwarded calls are (the follower's token
//! for the leader's id and epoch, `cluster::trust`); it is refused to
//! anyone else, and never forwarded.
//!
//! It lives beside `cluster`, not in it: it drives the engine, and the
//! engine consults the cluster's leadership.

pub mod follower;
pub mod leader;

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use standby_protocol::{AgentState, Secret};

use crate::cluster::Cluster;
pub use crate::cluster::LINK_PATH;
use crate::rules::AdmissionRefusal;

/// What a replica's ends of the links share: its cluster, the agents'
/// sockets it holds, and (while it leads) the replicas' links to it.
#[derive(Debug)]
pub struct Link {
    pub cluster: Cluster,
    pub hub: follower::Hub,
    pub links: leader::Links,
}

/// A follower's number for one agent's socket, for as long as it holds it.
pub type AgentId = u64;

/// From the follower to the leader.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Up {
    /// The agent presented `token` on its upgrade: claim its socket.
    Claim { agent: AgentId, token: Secret },
    /// The claimed agent's socket is open.
    Open { agent: AgentId },
    /// The agent reported `state`, another than it reported last (or the
    /// first since the claim).
    Heartbeat { agent: AgentId, state: AgentState },
    /// Routine heartbeats of these agents since the last gathering.
    Heard { agents: Vec<AgentId> },
    /// The assignment of `run_id` was written to the agent.
    Sent { agent: AgentId, run_id: String },
    /// The agent's socket closed (or its claim is given up).
    Gone { agent: AgentId },
}

/// From the leader to the follower.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Down {
    Claimed {
        agent: AgentId,
    },
    Refused {
        agent: AgentId,
        refusal: Refusal,
    },
    /// A text frame for the agent; for an assignment, the run it assigns.
    Frame {
        agent: AgentId,
        text: String,
        assignment_of: Option<String>,
    },
    Close {
        agent: AgentId,
    },
}

/// An [`AdmissionRefusal`] on the link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Refusal {
    Gone,
    Unauthorized,
    Ended,
    Duplicate { retry_after_ms: u64 },
}

impl From<AdmissionRefusal> for Refusal {
    fn from(refusal: AdmissionRefusal) -> Self {
        match refusal {
            AdmissionRefusal::Gone => Self::Gone,
            AdmissionRefusal::Unauthorized => Self::Unauthorized,
            AdmissionRefusal::Ended => Self::Ended,
            AdmissionRefusal::Duplicate { retry_after } => {
                Self::Duplicate { retry_after_ms: u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX) }
            }
        }
    }
}

impl From<Refusal> for AdmissionRefusal {
    fn from(refusal: Refusal) -> Self {
        match refusal {
            Refusal::Gone => Self::Gone,
            Refusal::Unauthorized => Self::Unauthorized,
            Refusal::Ended => Self::Ended,
            Refusal::Duplicate { retry_after_ms } => {
                Self::Duplicate { retry_after: Duration::from_millis(retry_after_ms) }
            }
        }
    }
}

/// Whether a link last heard at `heard` is dead at `now`: silent for
/// longer than the lease's time to live. Each end pings every
/// [`ping_period`], so a live link is never this silent.
pub fn silent(heard: Instant, now: Instant, ttl: Duration) -> bool {
    now.saturating_duration_since(heard) > ttl
}

/// Resolves once the replica stops (holding no borrow of the flag).
async fn stopping(shutdown: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

/// How often each end pings the other: three times a lease time.
pub fn ping_period(ttl: Duration) -> Duration {
    ttl / 3
}

/// How often a follower sends the routine heartbeats it gathered: often
/// enough that the leader hears an agent well within its silence limit
/// (three heartbeat intervals), at most once a second.
pub fn gather_period(heartbeat_interval: Duration) -> Duration {
    (heartbeat_interval / 2).clamp(Duration::from_millis(50), Duration::from_secs(1))
}

/// How long a follower keeps its agents' sockets without a link: three
/// lease times (a lapse, an election and a slow claim); then each agent
/// is told 1012 and reconnects on its own, through the balancer.
pub fn wait_bound(ttl: Duration) -> Duration {
    ttl * 3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wire_names_each_message_by_its_type() {
        let up = Up::Heartbeat { agent: 7, state: AgentState::Ready };
        assert_eq!(
            serde_json::to_value(&up).expect("serializes"),
            serde_json::json!({"type": "heartbeat", "agent": 7, "state": "ready"})
        );
        let down = Down::Refused { agent: 3, refusal: Refusal::Duplicate { retry_after_ms: 1500 } };
        let text = serde_json::to_string(&down).expect("serializes");
        assert_eq!(serde_json::from_str::<Down>(&text).expect("parses"), down);
    }

    #[test]
    fn a_claim_prints_no_token() {
        let claim = Up::Claim { agent: 1, token: Secret::new("sb_live_hunter2".to_owned()) };
        assert!(!format!("{claim:?}").contains("hunter2"));
    }

    #[test]
    fn every_refusal_crosses_the_link_unchanged() {
        for refusal in [
            AdmissionRefusal::Gone,
            AdmissionRefusal::Unauthorized,
            AdmissionRefusal::Ended,
            AdmissionRefusal::Duplicate { retry_after: Duration::from_millis(2500) },
        ] {
            assert_eq!(AdmissionRefusal::from(Refusal::from(refusal)), refusal);
        }
    }

    #[test]
    fn a_link_is_dead_once_silent_for_a_lease_time() {
        let (ttl, heard) = (Duration::from_secs(3), Instant::now());
        assert!(!silent(heard, heard + ttl, ttl));
        assert!(silent(heard, heard + ttl + Duration::from_millis(1), ttl));
        assert!(ping_period(ttl) * 3 <= ttl, "three pings within a lease time");
        assert_eq!(wait_bound(ttl), Duration::from_secs(9));
    }

    #[test]
    fn a_held_agent_waits_for_a_leader_as_long_as_a_forwarded_call_does() {
        let ttl = Duration::from_secs(3);
        assert_eq!(wait_bound(ttl), crate::cluster::forward::answer_bound(ttl));
    }

    #[test]
    fn gathered_heartbeats_reach_the_leader_within_an_interval() {
        assert_eq!(gather_period(Duration::from_secs(15)), Duration::from_secs(1));
        assert_eq!(gather_period(Duration::from_millis(500)), Duration::from_millis(250));
        assert_eq!(gather_period(Duration::from_millis(20)), Duration::from_millis(50));
    }
}
