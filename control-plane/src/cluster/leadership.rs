//! The one place leadership lives. A server that is no replica leads from
//! start to end ([`Leadership::sole`]); a replica leads while its claim
//! loop holds the lease, under a [`Fence`] (the lease's epoch, its local
//! deadline, the database's bound), and once it loses it, it is deposed for
//! good: the process exits, and its supervisor starts it again as a
//! follower. The claim loop publishes the [`ClusterView`] (role, epoch,
//! deadline) on a watch; the engine reads the fence from it for every
//! write, a refused write deposes it here, and the server ends on it.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::{ClusterView, Role};
use crate::store::Fence;

/// Whether this process may write and tell, and under which fence.
#[derive(Debug, Clone)]
pub struct Leadership(Kind);

#[derive(Debug, Clone)]
enum Kind {
    Sole,
    Replica {
        view: Arc<watch::Sender<ClusterView>>,
        /// The database's bound on a leader's write transaction.
        bound: Duration,
        /// Why it was deposed, set once.
        why: Arc<OnceLock<String>>,
    },
}

/// This process does not lead (any more): nothing is written or told.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("this replica does not lead (it is {role})")]
pub struct NotLeading {
    pub role: &'static str,
}

impl Leadership {
    /// A server that is no replica: it leads, unfenced, until it stops.
    pub fn sole() -> Self {
        Self(Kind::Sole)
    }

    /// A replica's, published on `view` by its claim loop; its writes are
    /// bounded by `bound` in the database.
    pub(super) fn replica(view: Arc<watch::Sender<ClusterView>>, bound: Duration) -> Self {
        Self(Kind::Replica { view, bound, why: Arc::default() })
    }

    /// The fence a write runs under now: `None` for a sole server.
    pub fn fence(&self) -> Result<Option<Fence>, NotLeading> {
        match &self.0 {
            Kind::Sole => Ok(None),
            Kind::Replica { view, bound, .. } => {
                let view = view.borrow();
                match (view.role, view.deadline) {
                    (Role::Leader, Some(deadline)) => Ok(Some(Fence { epoch: view.epoch, deadline, bound: *bound })),
                    (role, _) => Err(NotLeading { role: role.as_str() }),
                }
            }
        }
    }

    /// Whether this process may no longer act as the leader at `now`: not
    /// leading, or past the lease's local deadline (the claim loop deposes
    /// it then; an operation queued before is not carried out meanwhile).
    pub fn lapsed(&self, now: Instant) -> bool {
        match self.fence() {
            Ok(None) => false,
            Ok(Some(fence)) => fence.lapsed(now),
            Err(NotLeading { .. }) => true,
        }
    }

    /// It led and may no longer (a takeover, a lapsed lease, a write the
    /// store refused under a newer epoch): for good. Said once.
    pub fn depose(&self, why: &str) {
        let Kind::Replica { view, why: reason, .. } = &self.0 else { return };
        if reason.set(why.to_owned()).is_ok() {
            tracing::error!(replica = view.borrow().replica_id, why, "deposed: this replica leads no longer and exits");
        }
        view.send_modify(|view| {
            view.role = Role::Deposed;
            view.leader = None;
            view.deadline = None;
        });
    }

    /// Why it was deposed, if it was.
    pub fn deposition(&self) -> Option<String> {
        match &self.0 {
            Kind::Sole => None,
            Kind::Replica { why, view, .. } => {
                (view.borrow().role == Role::Deposed).then(|| why.get().cloned().unwrap_or_default())
            }
        }
    }

    /// Resolves with why once deposed (never for a sole server).
    pub async fn deposed(&self) -> String {
        if let Kind::Replica { view, .. } = &self.0 {
            let mut view = view.subscribe();
            if view.wait_for(|view| view.role == Role::Deposed).await.is_ok() {
                return self.deposition().unwrap_or_default();
            }
        }
        std::future::pending().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replica(role: Role, deadline: Option<Instant>) -> Leadership {
        let view = ClusterView { replica_id: "a".into(), role, leader: None, epoch: 7, expires_at: None, deadline };
        Leadership::replica(Arc::new(watch::channel(view).0), Duration::from_secs(1))
    }

    #[test]
    fn a_sole_server_leads_unfenced_and_is_never_deposed() {
        let sole = Leadership::sole();
        assert_eq!(sole.fence(), Ok(None));
        assert!(!sole.lapsed(Instant::now()));
        sole.depose("ignored");
        assert_eq!(sole.deposition(), None);
    }

    #[test]
    fn a_leading_replica_writes_under_its_epoch_until_its_deadline() {
        let now = Instant::now();
        let deadline = now + Duration::from_secs(5);
        let leader = replica(Role::Leader, Some(deadline));
        let fence = leader.fence().expect("leads").expect("fenced");
        assert_eq!((fence.epoch, fence.deadline, fence.bound), (7, deadline, Duration::from_secs(1)));
        assert!(!leader.lapsed(now));
        assert!(leader.lapsed(deadline), "past its local deadline it may tell nothing");
        let follower = replica(Role::Follower, None);
        assert_eq!(follower.fence(), Err(NotLeading { role: "follower" }));
        assert!(follower.lapsed(now));
    }

    #[tokio::test]
    async fn a_deposed_replica_stays_deposed_and_says_why_once() {
        let leader = replica(Role::Leader, Some(Instant::now() + Duration::from_secs(5)));
        let waiting = tokio::spawn({
            let leader = leader.clone();
            async move { leader.deposed().await }
        });
        leader.depose("the store refused a write at epoch 7: epoch 8 holds the lease");
        leader.depose("a second reason is not kept");
        assert_eq!(waiting.await.expect("resolves"), "the store refused a write at epoch 7: epoch 8 holds the lease");
        assert_eq!(leader.fence(), Err(NotLeading { role: "deposed" }));
        assert!(leader.deposition().is_some_and(|why| why.contains("epoch 8")));
    }
}
