//! The leader's lease on PostgreSQL: acquire and renew in one statement
//! with the database's clock once the lease row is locked, the fence every
//! write of a leader passes, the bounds the database enforces on both, and
//! the replicas' register (`GET /v1/cluster`).

use std::time::{Duration, Instant};

use deadpool_postgres::{Object, Transaction};
use tokio_postgres::NoTls;

use super::{PostgresStore, query, to_i64, to_u64};
use crate::model::Millis;
use crate::store::{Fence, LeaseRow, LeaseStore, ReplicaRow, StoreError};

/// Takes the lease when expired (the next epoch), renews it when `$1` holds
/// it at `$3` and it runs; else changes nothing. The `UPDATE` and the
/// read of the row as it was are one statement: the answer is the row
/// after the claim, or as another holds it. It runs once the row is locked
/// ([`LOCK_ROW`]), and its clock is the statement's start: a claim that
/// waited for the lock judges and grants the lease as of when it got it,
/// never as of when it began (`now()`, the transaction's start, granted
/// queued claims leases that had run out before they were granted).
const CLAIM: &str = "
WITH claimed AS (
    UPDATE cluster_lease SET
        epoch = CASE WHEN holder = $1 AND epoch = $3 AND expires_at > statement_timestamp()
                     THEN epoch ELSE epoch + 1 END,
        holder = $1, holder_url = $2, expires_at = statement_timestamp() + $4::bigint * interval '1 millisecond'
    WHERE id = 1 AND ((holder = $1 AND epoch = $3 AND expires_at > statement_timestamp())
                      OR expires_at <= statement_timestamp())
    RETURNING epoch, holder, holder_url, expires_at, true AS ours
), answer AS (
    SELECT * FROM claimed
    UNION ALL
    SELECT epoch, holder, holder_url, expires_at, false FROM cluster_lease
    WHERE id = 1 AND NOT EXISTS (SELECT 1 FROM claimed)
)
SELECT epoch, holder, holder_url, ours,
       GREATEST(0, (EXTRACT(EPOCH FROM (expires_at - statement_timestamp())) * 1000)::bigint),
       (EXTRACT(EPOCH FROM expires_at) * 1000)::bigint
FROM answer";

/// A claim's first statement: the lease row, locked until the claim
/// commits. It waits for every write transaction holding the row `FOR
/// SHARE` (see [`check_epoch`]), for at most the claim's bound.
///
/// [`check_epoch`]: PostgresStore::check_epoch
const LOCK_ROW: &str = "SELECT 1 FROM cluster_lease WHERE id = 1 FOR UPDATE";

/// The database's side of a bound: a transaction that waits on a lock,
/// runs a statement or sits idle between two (its client frozen or cut
/// off) for `bound` is ended by the database, and its locks released.
async fn bound_transaction(transaction: &Transaction<'_>, bound: Duration) -> Result<(), tokio_postgres::Error> {
    let ms = bound.as_millis().max(1);
    transaction
        .batch_execute(&format!(
            "SET LOCAL lock_timeout = {ms}; SET LOCAL statement_timeout = {ms}; \
             SET LOCAL idle_in_transaction_session_timeout = {ms}"
        ))
        .await
}

impl PostgresStore {
    /// Refuses once the fence's local deadline has passed.
    pub(super) fn check_deadline(&self, fence: Fence) -> Result<(), StoreError> {
        let now = Instant::now();
        if now < fence.deadline {
            return Ok(());
        }
        Err(StoreError::LeaseLapsed { store: self.name.clone(), late: now - fence.deadline })
    }

    /// The first statements of a fenced transaction: the database's bounds
    /// on it, then the lease row, locked `FOR SHARE` until the commit (a
    /// claim waits for it), which must be at our epoch and running.
    pub(super) async fn check_epoch(&self, transaction: &Transaction<'_>, fence: Fence) -> Result<(), StoreError> {
        let failed = self.failed("check the lease");
        bound_transaction(transaction, fence.bound).await.map_err(&failed)?;
        let sql = "SELECT epoch, GREATEST(0, (EXTRACT(EPOCH FROM (expires_at - clock_timestamp())) * 1000)::bigint)
                   FROM cluster_lease WHERE id = 1 FOR SHARE";
        let rows = query(transaction, sql, &[]).await.map_err(&failed)?;
        let (current, left) = match rows.first() {
            Some(row) => (to_u64(row.try_get(0).map_err(&failed)?), to_u64(row.try_get(1).map_err(&failed)?)),
            None => (0, 0),
        };
        let refused = if current != fence.epoch {
            StoreError::Fenced { store: self.name.clone(), held: fence.epoch, current }
        } else if left == 0 {
            StoreError::LeaseEnding { store: self.name.clone(), left: Duration::ZERO, bound: fence.bound }
        } else {
            return Ok(());
        };
        Err(refused)
    }

    /// The last statement before a fenced commit: the lease (still locked
    /// by us, so nobody took it since [`Self::check_epoch`]) must have more
    /// than the bound left by the database's clock. Past this check the
    /// transaction either commits within the bound (else the database ends
    /// it as idle), so before the lease ends, or not at all.
    pub(super) async fn check_ending(&self, transaction: &Transaction<'_>, fence: Fence) -> Result<(), StoreError> {
        let failed = self.failed("check the lease");
        let sql = "SELECT GREATEST(0, (EXTRACT(EPOCH FROM (expires_at - clock_timestamp())) * 1000)::bigint)
                   FROM cluster_lease WHERE id = 1";
        let rows = query(transaction, sql, &[]).await.map_err(&failed)?;
        let left = rows.first().map(|row| row.try_get(0)).transpose().map_err(&failed)?.map_or(0, to_u64);
        let left = Duration::from_millis(left);
        if left > fence.bound {
            return Ok(());
        }
        Err(StoreError::LeaseEnding { store: self.name.clone(), left, bound: fence.bound })
    }

    /// One claim on `client`, bounded by the database (see [`CLAIM`]).
    async fn claim_on(
        &self,
        client: &mut Object,
        replica: &str,
        url: &str,
        epoch: u64,
        ttl: Duration,
        bound: Duration,
    ) -> Result<LeaseRow, StoreError> {
        let failed = self.failed("claim the lease");
        let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
        let transaction = client.transaction().await.map_err(&failed)?;
        bound_transaction(&transaction, bound).await.map_err(&failed)?;
        let seen = "INSERT INTO cluster_replicas (id, url, seen_at) VALUES ($1, $2, now())
                    ON CONFLICT (id) DO UPDATE SET url = excluded.url, seen_at = excluded.seen_at";
        query(&transaction, seen, &[&replica, &url]).await.map_err(&failed)?;
        query(&transaction, LOCK_ROW, &[]).await.map_err(&failed)?;
        let rows = query(&transaction, CLAIM, &[&replica, &url, &to_i64(epoch), &ttl_ms]).await.map_err(&failed)?;
        let row = rows.first().ok_or_else(|| StoreError::Postgres {
            store: self.name.clone(),
            operation: "claim the lease",
            detail: "the lease row is missing (migration 3 inserts it)".into(),
        })?;
        let lease = LeaseRow {
            epoch: to_u64(row.try_get(0).map_err(&failed)?),
            holder: row.try_get(1).map_err(&failed)?,
            holder_url: row.try_get(2).map_err(&failed)?,
            ours: row.try_get(3).map_err(&failed)?,
            remaining: Duration::from_millis(to_u64(row.try_get(4).map_err(&failed)?)),
            expires_at: Millis(row.try_get(5).map_err(&failed)?),
        };
        transaction.commit().await.map_err(&failed)?;
        Ok(lease)
    }
}

impl LeaseStore for PostgresStore {
    fn claim(
        &self,
        replica: &str,
        url: &str,
        epoch: u64,
        ttl: Duration,
        bound: Duration,
    ) -> Result<LeaseRow, StoreError> {
        // The database ends the claim after `bound`; this is for a database
        // that does not answer at all (a partition, a dead host).
        let guard = tokio::time::Instant::now() + 2 * bound;
        let late = || StoreError::Postgres {
            store: self.name.clone(),
            operation: "claim the lease",
            detail: format!("no answer within {:?}", 2 * bound),
        };
        self.driver.block_on(async {
            let mut client = tokio::time::timeout_at(guard, self.client()).await.map_err(|_| late())??;
            let claimed = tokio::time::timeout_at(guard, self.claim_on(&mut client, replica, url, epoch, ttl, bound));
            match claimed.await {
                Ok(answer) => answer,
                Err(_) => {
                    // Unanswered: the connection leaves the pool (it may
                    // never answer again), and the claim is cancelled if the
                    // database still hears us.
                    let cancel = client.cancel_token();
                    drop(Object::take(client));
                    tokio::spawn(async move { cancel.cancel_query(NoTls).await });
                    Err(late())
                }
            }
        })
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
