//! The leader's lease on PostgreSQL: acquire and renew in one statement
//! with the database's clock, the fence every write of a leader passes,
//! and the replicas' register (`GET /v1/cluster`).

use std::sync::PoisonError;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use deadpool_postgres::Transaction;

use super::{PostgresStore, query, to_i64, to_u64};
use crate::model::Millis;
use crate::store::{LeaseRow, LeaseStore, ReplicaRow, StoreError};

/// The epoch a leader writes under and its local deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Fence {
    pub epoch: u64,
    pub deadline: Instant,
}

/// Takes the lease when expired (the next epoch), renews it when `$1` holds
/// it at `$3` and it runs; else changes nothing. The `UPDATE` and the
/// read of the row as it was are one statement: the answer is the row
/// after the claim, or as another holds it. The `UPDATE` waits for every
/// write transaction holding the row `FOR SHARE` (see [`check_epoch`]).
///
/// [`check_epoch`]: PostgresStore::check_epoch
const CLAIM: &str = "
WITH claimed AS (
    UPDATE cluster_lease SET
        epoch = CASE WHEN holder = $1 AND epoch = $3 AND expires_at > now() THEN epoch ELSE epoch + 1 END,
        holder = $1, holder_url = $2, expires_at = now() + $4::bigint * interval '1 millisecond'
    WHERE id = 1 AND ((holder = $1 AND epoch = $3 AND expires_at > now()) OR expires_at <= now())
    RETURNING epoch, holder, holder_url, expires_at, true AS ours
), answer AS (
    SELECT * FROM claimed
    UNION ALL
    SELECT epoch, holder, holder_url, expires_at, false FROM cluster_lease
    WHERE id = 1 AND NOT EXISTS (SELECT 1 FROM claimed)
)
SELECT epoch, holder, holder_url, ours,
       GREATEST(0, (EXTRACT(EPOCH FROM (expires_at - now())) * 1000)::bigint),
       (EXTRACT(EPOCH FROM expires_at) * 1000)::bigint
FROM answer";

impl PostgresStore {
    /// Refuses (and marks this replica deposed) once the fence's local
    /// deadline has passed.
    pub(super) fn check_deadline(&self, fence: Fence) -> Result<(), StoreError> {
        let now = Instant::now();
        if now < fence.deadline {
            return Ok(());
        }
        self.deposed.store(true, Ordering::Relaxed);
        Err(StoreError::LeaseLapsed { store: self.name.clone(), late: now - fence.deadline })
    }

    /// The first statement of a fenced transaction: the lease row, locked
    /// `FOR SHARE` until the commit, must be at our epoch.
    pub(super) async fn check_epoch(&self, transaction: &Transaction<'_>, epoch: u64) -> Result<(), StoreError> {
        let rows = query(transaction, "SELECT epoch FROM cluster_lease WHERE id = 1 FOR SHARE", &[])
            .await
            .map_err(self.failed("check the lease"))?;
        let current = rows
            .first()
            .map(|row| row.try_get::<_, i64>(0))
            .transpose()
            .map_err(self.failed("check the lease"))?
            .map_or(0, to_u64);
        if current == epoch {
            return Ok(());
        }
        self.deposed.store(true, Ordering::Relaxed);
        Err(StoreError::Fenced { store: self.name.clone(), held: epoch, current })
    }
}

impl LeaseStore for PostgresStore {
    fn claim(&self, replica: &str, url: &str, epoch: u64, ttl: Duration) -> Result<LeaseRow, StoreError> {
        let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
        self.driver.block_on(async {
            let failed = self.failed("claim the lease");
            let client = self.client().await?;
            let seen = "INSERT INTO cluster_replicas (id, url, seen_at) VALUES ($1, $2, now())
                        ON CONFLICT (id) DO UPDATE SET url = excluded.url, seen_at = excluded.seen_at";
            query(&client, seen, &[&replica, &url]).await.map_err(&failed)?;
            let rows = query(&client, CLAIM, &[&replica, &url, &to_i64(epoch), &ttl_ms]).await.map_err(&failed)?;
            let row = rows.first().ok_or_else(|| StoreError::Postgres {
                store: self.name.clone(),
                operation: "claim the lease",
                detail: "the lease row is missing (migration 3 inserts it)".into(),
            })?;
            Ok(LeaseRow {
                epoch: to_u64(row.try_get(0).map_err(&failed)?),
                holder: row.try_get(1).map_err(&failed)?,
                holder_url: row.try_get(2).map_err(&failed)?,
                ours: row.try_get(3).map_err(&failed)?,
                remaining: Duration::from_millis(to_u64(row.try_get(4).map_err(&failed)?)),
                expires_at: Millis(row.try_get(5).map_err(&failed)?),
            })
        })
    }

    fn fence(&self, epoch: u64, deadline: Instant) {
        *self.fence.lock().unwrap_or_else(PoisonError::into_inner) = Some(Fence { epoch, deadline });
    }

    fn deposed(&self) -> bool {
        self.deposed.load(Ordering::Relaxed)
    }

    fn replicas(&self) -> Result<Vec<ReplicaRow>, StoreError> {
        self.driver.block_on(async {
            let failed = self.failed("read the replicas");
            let client = self.client().await?;
            let sql = "SELECT id, url, (EXTRACT(EPOCH FROM seen_at) * 1000)::bigint FROM cluster_replicas
                       ORDER BY seen_at DESC, id";
            let rows = query(&client, sql, &[]).await.map_err(&failed)?;
            rows.iter()
                .map(|row| {
                    Ok(ReplicaRow { id: row.try_get(0)?, url: row.try_get(1)?, seen_at: Millis(row.try_get(2)?) })
                })
                .collect::<Result<Vec<_>, tokio_postgres::Error>>()
                .map_err(&failed)
        })
    }
}
