//! A replicated deployment (`--store postgres://…`): every `serve` on one
//! database is a replica, one of them (the holder of the lease row) the
//! leader that runs the engine; the others forward every call to it
//! ([`forward`]) and hold the sockets of the agents that reached them,
//! speaking for them over one link to it (`crate::link`), once it proved
//! the cluster secret they share ([`trust`], [`secret`]).
//!
//! This module is the IO half: a loop that claims the lease every third of
//! its time to live, lets the pure [`lease`] rules decide, and publishes
//! the [`ClusterView`] (with the fence a leader writes under) on a
//! `watch`, which [`Leadership`] reads. Leadership is taken once per
//! process: a leader that loses the lease is [`Role::Deposed`] and the
//! process exits (`standby-server --help`, exit code 3); its supervisor
//! starts it again, as a follower.

pub mod forward;
mod leadership;
pub mod lease;
pub mod secret;
pub mod trust;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::watch;

pub use self::leadership::{Leadership, NotLeading};
use self::lease::{Lease, LeaseTimes, Outcome};
use self::secret::ClusterSecret;
use crate::listener::ListenerStats;
use crate::model::Millis;
use crate::store::LeaseStore;

/// The exit code of a deposed leader (and of a replica that lost its
/// store while it led): restart it, it comes back as a follower.
pub const DEPOSED_EXIT_CODE: u8 = 3;

/// What this replica is called, how long a lease runs, and what proves a
/// replica.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    pub replica_id: String,
    /// The URL other replicas forward to when this one leads; its own
    /// listening address (`http://<bound address>`) when unset, never the
    /// public URL, which may be a load balancer's.
    pub advertise_url: Option<String>,
    /// The lease's time to live and its leader's renew deadline.
    pub times: LeaseTimes,
    pub secret: ClusterSecret,
}

/// This replica's part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// No answer from the database yet.
    Candidate,
    Follower,
    Leader,
    /// It led and may no longer: the process is exiting.
    Deposed,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Candidate => "candidate",
            Self::Follower => "follower",
            Self::Leader => "leader",
            Self::Deposed => "deposed",
        }
    }
}

/// What this replica knows of the cluster, as of its last claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterView {
    pub replica_id: String,
    pub role: Role,
    /// The leader's id and URL, when one holds a running lease.
    pub leader: Option<(String, String)>,
    pub epoch: u64,
    /// When the lease expires, by the database's clock.
    pub expires_at: Option<Millis>,
    /// While this replica leads: when it stops unless renewed, by its own
    /// clock (the fence its writes run under).
    pub deadline: Option<Instant>,
}

/// The counters of `/metrics` about the cluster.
#[derive(Debug, Default)]
pub struct ClusterStats {
    pub leadership_changes: AtomicU64,
    pub forwarded_requests: AtomicU64,
    /// Agents' sockets this replica holds and speaks for over its link.
    pub held_agents: AtomicI64,
    /// Links made after the first (to a new leader, or after one dropped).
    pub relinks: AtomicU64,
    /// Replicas linked to this one while it leads.
    pub linked_replicas: AtomicI64,
    /// Links this replica accepted (each one's number).
    pub links_accepted: AtomicU64,
}

/// What the router and the handlers share about the cluster.
#[derive(Debug, Clone)]
pub struct Cluster {
    pub view: watch::Receiver<ClusterView>,
    pub stats: Arc<ClusterStats>,
    pub lease: Arc<dyn LeaseStore>,
    /// Whether this replica leads, under which fence; its end.
    pub leadership: Leadership,
    /// The lease's time to live: a relay waits three for a new leader.
    pub ttl: Duration,
    /// Turns true when the replica stops: relayed sockets close with 1012.
    pub shutdown: watch::Receiver<bool>,
    /// What the replicas prove themselves with.
    pub secret: Arc<ClusterSecret>,
    /// This replica's advertised URL, which its proofs bind.
    pub url: String,
    /// The last leader that proved the secret to this replica.
    pub proven: Arc<trust::Proven>,
    /// The listener's cap, which a connection to the leader counts under.
    pub listener: Arc<ListenerStats>,
}

impl Cluster {
    pub fn leading(&self) -> bool {
        self.view.borrow().role == Role::Leader
    }

    /// Prometheus lines of the cluster's gauges and counters.
    pub fn render_metrics(&self) -> String {
        let leader = u8::from(self.leading());
        format!(
            "# HELP standby_leader Whether this replica leads (1) or not (0).\n# TYPE standby_leader gauge\n\
             standby_leader {leader}\n\
             # HELP standby_lease_epoch The lease's epoch as this replica last read it: one more at each change of \
             leader.\n# TYPE standby_lease_epoch gauge\nstandby_lease_epoch {}\n\
             # HELP standby_leadership_changes_total Times this replica took the lease.\n\
             # TYPE standby_leadership_changes_total counter\nstandby_leadership_changes_total {}\n\
             # HELP standby_forwarded_requests_total HTTP calls this replica forwarded to the leader.\n\
             # TYPE standby_forwarded_requests_total counter\nstandby_forwarded_requests_total {}\n\
             # HELP standby_held_agents Agents' control sockets this replica holds and speaks for over its link.\n\
             # TYPE standby_held_agents gauge\nstandby_held_agents {}\n\
             # HELP standby_relinks_total Links to the leader made after the first, the agents' sockets kept.\n\
             # TYPE standby_relinks_total counter\nstandby_relinks_total {}\n\
             # HELP standby_linked_replicas Replicas linked to this one while it leads.\n\
             # TYPE standby_linked_replicas gauge\nstandby_linked_replicas {}\n",
            self.view.borrow().epoch,
            self.stats.leadership_changes.load(Ordering::Relaxed),
            self.stats.forwarded_requests.load(Ordering::Relaxed),
            self.stats.held_agents.load(Ordering::Relaxed),
            self.stats.relinks.load(Ordering::Relaxed),
            self.stats.linked_replicas.load(Ordering::Relaxed),
        )
    }
}

/// The route of the agents' link on the leader (`crate::link`): only a
/// replica links, and the link is never forwarded.
pub const LINK_PATH: &str = "/v1/cluster/link";

/// Starts the claim loop of replica `config` advertised at `url` (its
/// `advertise_url`, else its own address); it runs until `shutdown` turns
/// true or this replica is deposed.
pub fn start(
    config: ClusterConfig,
    url: String,
    lease: Arc<dyn LeaseStore>,
    listener: Arc<ListenerStats>,
    shutdown: watch::Receiver<bool>,
) -> Cluster {
    let (view_tx, view) = watch::channel(ClusterView {
        replica_id: config.replica_id.clone(),
        role: Role::Candidate,
        leader: None,
        epoch: 0,
        expires_at: None,
        deadline: None,
    });
    let view_tx = Arc::new(view_tx);
    let leadership =
        Leadership::replica(Arc::clone(&view_tx), Lease::new(&config.replica_id, config.times).write_bound());
    let stats = Arc::new(ClusterStats::default());
    let (ttl, secret) = (config.times.ttl, Arc::new(config.secret.clone()));
    let claims =
        Claims { store: Arc::clone(&lease), view: view_tx, leadership: leadership.clone(), stats: Arc::clone(&stats) };
    tokio::spawn(claim_loop(config, url.clone(), claims, shutdown.clone()));
    Cluster { view, stats, lease, leadership, ttl, shutdown, secret, url, proven: Arc::default(), listener }
}

/// What the claim loop works on.
struct Claims {
    store: Arc<dyn LeaseStore>,
    view: Arc<watch::Sender<ClusterView>>,
    leadership: Leadership,
    stats: Arc<ClusterStats>,
}

async fn claim_loop(config: ClusterConfig, url: String, claims: Claims, mut shutdown: watch::Receiver<bool>) {
    let Claims { store, view, leadership, stats } = claims;
    let me = config.replica_id.clone();
    let mut lease = Lease::new(&me, config.times);
    let ttl = config.times.ttl;
    let period = lease.period();
    loop {
        let started = Instant::now();
        let claim = {
            let (store, me, url, epoch) = (Arc::clone(&store), me.clone(), url.clone(), lease.epoch());
            let bound = lease.claim_bound();
            tokio::task::spawn_blocking(move || store.claim(&me, &url, epoch, ttl, bound))
        };
        // A leader's deadline is watched below whatever a claim takes.
        let answer = match tokio::time::timeout(ttl / 2, claim).await {
            Ok(Ok(Ok(row))) => Some(row),
            Ok(Ok(Err(error))) => {
                tracing::warn!(%error, "claiming the lease failed");
                None
            }
            Ok(Err(join)) => std::panic::resume_unwind(join.into_panic()),
            Err(_) => {
                tracing::warn!(bound = ?ttl / 2, "claiming the lease took too long");
                None
            }
        };
        if leadership.deposition().is_some() {
            // A write the store refused deposed it meanwhile: for good.
            return;
        }
        let outcome = lease.observe(started, answer.as_ref(), Instant::now());
        let expires_at = answer.as_ref().map(|row| row.expires_at);
        match outcome {
            Outcome::Lead { epoch, deadline } => {
                stats.leadership_changes.fetch_add(1, Ordering::Relaxed);
                tracing::info!(replica = me, epoch, "took the lease: this replica leads");
                view.send_replace(ClusterView {
                    replica_id: me.clone(),
                    role: Role::Leader,
                    leader: Some((me.clone(), url.clone())),
                    epoch,
                    expires_at,
                    deadline: Some(deadline),
                });
            }
            Outcome::Renewed { deadline } => {
                view.send_modify(|view| {
                    view.expires_at = expires_at;
                    view.deadline = Some(deadline);
                });
            }
            Outcome::Follow { leader, epoch } => {
                view.send_if_modified(|view| {
                    let next = ClusterView {
                        replica_id: me.clone(),
                        role: Role::Follower,
                        leader,
                        epoch,
                        expires_at,
                        deadline: None,
                    };
                    let changed = view.leader != next.leader || view.role != next.role;
                    if changed {
                        tracing::info!(leader = ?next.leader, epoch, "following");
                    }
                    *view = next;
                    changed
                });
            }
            Outcome::Unchanged => {}
            Outcome::Deposed(why) => {
                leadership.depose(&why.to_string());
                return;
            }
        }
        let deadline = lease.deadline();
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = sleep_until(deadline) => {
                leadership.depose(&lease::Deposition::DeadlinePassed.to_string());
                return;
            }
            _ = shutdown.wait_for(|stop| *stop) => return,
            _ = leadership.deposed() => return,
        }
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline.into()).await,
        None => std::future::pending().await,
    }
}
