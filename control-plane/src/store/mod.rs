//! Durable records behind a trait, and two implementations: an embedded
//! SQLite file ([`SqliteStore`], the default: no external service) and a
//! PostgreSQL database ([`PostgresStore`], `--store postgres://…`, for a
//! control plane whose store lives on a database of its own).
//!
//! Both keep the same rules, held by one set of contract tests
//! (`contract_tests.rs`, run on each):
//! - Records are JSON documents keyed by id; a [`Step`]'s writes are
//!   applied in one transaction, so a crash leaves either all of a decision
//!   or none of it, and the engine tells nobody anything before the commit.
//! - Thread pointers are written compare-and-set on their generation: a
//!   write that expected another generation (a stale writer, such as a
//!   second server on the same store) fails the whole transaction.
//! - Credentials are stored only as hashes (see [`crate::credential`]).
//! - What a run was submitted with (secrets, cloud env, git passwords,
//!   attachments, metadata) must be served to its agent, so it is kept, but
//!   only sealed ([`crate::seal`], bound to the run id), and deleted in the
//!   transaction that makes the run terminal: after that nothing may fetch it.
//! - Events are unique per (run, event id); a start loads only unfinished
//!   runs (finished ones are counted, and read from the store when asked for).
//!
//! Calls block; the engine and the API run them on the blocking pool.
//!
//! [`Step`]: crate::rules::Step

mod postgres;
mod sqlite;

#[cfg(test)]
mod contract_tests;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;
use standby_protocol::Secret;

pub use self::postgres::{PostgresStore, redact_url};
pub use self::sqlite::SqliteStore;
use crate::model::{Millis, RunPath, RunRecord, RunRequest, RunState, StoredEvent};
use crate::rules::{LogLedger, Snapshot, Write};
use crate::seal::{SealKey, Sealer};

/// A store operation that failed, naming the store (a file path, or a
/// PostgreSQL URL without its password) and what was being done.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store {store}: {operation}: {source}")]
    Sqlite {
        store: String,
        operation: &'static str,
        #[source]
        source: rusqlite::Error,
    },
    /// `detail` is the driver's error with its causes (the server's
    /// message, or why the connection failed).
    #[error("store {store}: {operation}: {detail}")]
    Postgres { store: String, operation: &'static str, detail: String },
    #[error("store {store}: not a PostgreSQL connection URL: {problem}")]
    Url { store: String, problem: String },
    #[error(
        "store {store}: the database's schema is at version {found}, newer than this standby-server's {known}: \
         run a standby-server that knows version {found} (or restore the database)"
    )]
    SchemaTooNew { store: String, found: i32, known: i32 },
    #[error(
        "store {store}: the database's schema is at version {found} and this standby-server needs migration \
         {needed} ({name}), which its role may not apply ({detail}): run `standby-server migrate` with the role \
         that owns the schema (docs/operations.md, \"Database roles\")"
    )]
    MigrationNeeded { store: String, found: i32, needed: i32, name: &'static str, detail: String },
    #[error("store {store}: record `{id}` in `{table}` is unreadable: {problem}")]
    Corrupt { store: String, table: &'static str, id: String, problem: String },
    #[error(
        "store {store}: thread `{thread_id}` pointer expected at generation {expected} is at {found}: another writer moved it"
    )]
    StalePointer { store: String, thread_id: String, expected: u64, found: u64 },
    #[error("store {store}: cannot create the directory {dir}: {source}")]
    Directory {
        store: String,
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("store {store}: cannot make {file} readable by its owner only: {source}")]
    Permissions {
        store: String,
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A write of a leader whose lease another replica has taken since:
    /// rolled back (`docs/operations.md`, "Replicated deployment").
    #[error(
        "store {store}: fenced: this replica writes under lease epoch {held}, the database's lease is at epoch {current}: \
         another replica leads now"
    )]
    Fenced { store: String, held: u64, current: u64 },
    /// The local deadline of this replica's lease (the start of its last
    /// successful renew plus the lease's time to live) passed: another
    /// replica may lead by now, so nothing more is told or launched.
    #[error("store {store}: this replica's lease lapsed {late:?} ago by its own clock: it may lead no longer")]
    LeaseLapsed { store: String, late: std::time::Duration },
    /// The database's lease, checked inside the write transaction just
    /// before its commit, had less than the write bound left: a commit
    /// could land after it ran out, so the transaction is rolled back.
    #[error(
        "store {store}: the lease has {left:?} left by the database's clock, less than the {bound:?} a commit may \
         still take: rolled back, this replica may lead no longer"
    )]
    LeaseEnding { store: String, left: std::time::Duration, bound: std::time::Duration },
    /// The sealing key differs from the one whose check the store keeps
    /// (written by the first server that opened it): what one replica
    /// sealed, another could not open.
    #[error(
        "store {store}: this server's secret key is not the store's: the store was first opened with another \
         key (its check does not match); give every replica the same --secret-key-file"
    )]
    SealKeyMismatch { store: String },
    /// A fence given to a store that keeps no lease (SQLite: one server's).
    #[error("store {store} keeps no lease: it cannot write under a leader's fence")]
    Unfenceable { store: String },
    #[error("store {store}: cannot start the store's connection thread: {source}")]
    Runtime {
        store: String,
        #[source]
        source: std::io::Error,
    },
}

impl StoreError {
    /// Whether the store refused a write for the lease: the writer leads no
    /// longer.
    pub fn deposes(&self) -> bool {
        matches!(self, Self::Fenced { .. } | Self::LeaseLapsed { .. } | Self::LeaseEnding { .. })
    }
}

/// Where the server keeps runs, sandboxes, credentials, events and logs.
pub trait Store: Send + Sync + 'static {
    /// Everything the dispatch state machine needs after a restart.
    fn load(&self) -> Result<Snapshot, StoreError>;
    /// Applies `writes` in one transaction: all or nothing. Under a
    /// `fence` (a leader's, [`crate::cluster::Leadership::fence`]) the
    /// transaction commits only while the fence's lease holds, and runs
    /// even without writes: so a deposed leader tells nobody anything. A
    /// store that keeps no lease refuses a fence.
    fn apply(&self, writes: &[Write], fence: Option<&Fence>) -> Result<(), StoreError>;
    /// What a run was submitted with (secrets included); `None` once the
    /// run is terminal: a write of a terminal run deletes it in the same
    /// transaction.
    fn request(&self, run_id: &str) -> Result<Option<RunRequest>, StoreError>;
    /// One run, finished or not.
    fn run(&self, run_id: &str) -> Result<Option<RunRecord>, StoreError>;
    /// A page of runs in submission order (`submitted_at`, then id).
    fn runs(&self, query: &RunQuery) -> Result<Vec<RunRecord>, StoreError>;
    /// Up to `limit` of the run's events received after sequence number
    /// `after` (`0`: from the first), in arrival order, with their numbers.
    fn events(&self, run_id: &str, after: u64, limit: usize) -> Result<Vec<(u64, StoredEvent)>, StoreError>;
    /// Where the run's log stands; `None` before its first chunk.
    fn log_ledger(&self, run_id: &str) -> Result<Option<LogLedger>, StoreError>;
    /// Up to `limit` stored pieces of the run's log (as received, redacted
    /// by the agent) that end after stream offset `from`, in order, each
    /// with its stream offset. Bytes between pieces are gaps.
    fn log_pieces(&self, run_id: &str, from: u64, limit: usize) -> Result<Vec<(u64, Vec<u8>)>, StoreError>;
    /// A keyed digest of `bytes` under this store's seal key
    /// ([`Sealer::digest`]): what is kept of a request to recognise its
    /// retries, stable across restarts on the same key, and no help to
    /// whoever reads the database in guessing the secrets it carried.
    fn digest(&self, bytes: &[u8]) -> String;
}

/// What a leader's writes run under: its lease's `epoch` (a write fails,
/// rolled back, once the database's lease is at another one or has less
/// than `bound` left), its local `deadline` (none starts or is told of
/// after it, by this process's clock), and `bound`, how long the database
/// lets one of its write transactions wait, run a statement or sit idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fence {
    pub epoch: u64,
    pub deadline: std::time::Instant,
    pub bound: std::time::Duration,
}

impl Fence {
    /// Whether the deadline has passed at `now`.
    pub fn lapsed(&self, now: std::time::Instant) -> bool {
        now >= self.deadline
    }
}

/// The leader's lease of a replicated deployment, as the database has it
/// after a [`LeaseStore::claim`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRow {
    pub epoch: u64,
    /// The holder's replica id and the URL other replicas reach it at
    /// (both empty before anyone held it).
    pub holder: String,
    pub holder_url: String,
    /// Whether this claim took or renewed it (else another holds it).
    pub ours: bool,
    /// How long it still runs by the database's clock (zero once expired).
    pub remaining: std::time::Duration,
    /// When it expires, by the database's clock.
    pub expires_at: Millis,
}

/// A replica as it last claimed the lease (`GET /v1/cluster`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaRow {
    pub id: String,
    pub url: String,
    pub seen_at: Millis,
}

/// The lease and fencing of a replicated deployment: only PostgreSQL has
/// them (a SQLite file is one server's).
pub trait LeaseStore: std::fmt::Debug + Send + Sync + 'static {
    /// With the database's clock as of when the lease row is locked: takes
    /// the lease when it has expired (at the next epoch), renews it when
    /// `replica` holds it at `epoch` (`0`: we hold none) and it has not
    /// expired; else leaves it. Records `replica` as seen at `url`. The
    /// database ends the claim after `bound` (waiting on the row's lock
    /// included), and the call returns within twice that whatever the
    /// database does. Blocks.
    fn claim(
        &self,
        replica: &str,
        url: &str,
        epoch: u64,
        ttl: std::time::Duration,
        bound: std::time::Duration,
    ) -> Result<LeaseRow, StoreError>;
    /// Every replica that ever claimed, most recently seen first. Blocks.
    fn replicas(&self) -> Result<Vec<ReplicaRow>, StoreError>;
}

/// An opened store, and its lease when it is a shared database.
#[derive(Clone)]
pub struct Opened {
    pub store: Arc<dyn Store>,
    pub lease: Option<Arc<dyn LeaseStore>>,
}

impl std::fmt::Debug for Opened {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opened").field("replicated", &self.lease.is_some()).finish_non_exhaustive()
    }
}

/// Which runs a page of [`Store::runs`] holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunQuery {
    /// The last run of the previous page (`submitted_at`, id).
    pub after: Option<(Millis, String)>,
    pub limit: usize,
    pub state: Option<RunState>,
    pub thread_id: Option<String>,
    /// Newest submission first (the status page's latest runs), `after`
    /// then meaning "older than"; oldest first otherwise (the API's pages).
    pub newest_first: bool,
}

/// Which store `--store` names: a PostgreSQL URL (`postgres://` or
/// `postgresql://`), else a SQLite file. Debug never shows a password.
#[derive(Clone, PartialEq, Eq)]
pub enum StoreLocation {
    Sqlite(PathBuf),
    Postgres(Secret),
}

impl std::fmt::Debug for StoreLocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Sqlite(path) => f.debug_tuple("Sqlite").field(path).finish(),
            Self::Postgres(url) => f.debug_tuple("Postgres").field(&redact_url(url.expose())).finish(),
        }
    }
}

impl StoreLocation {
    /// What `--store` says; `<data dir>/standby.db` when it is unset.
    pub fn from_arg(given: Option<OsString>, data_dir: &Path) -> Self {
        let Some(given) = given else { return Self::Sqlite(data_dir.join("standby.db")) };
        match given.to_str() {
            Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
                Self::Postgres(Secret::new(url))
            }
            _ => Self::Sqlite(PathBuf::from(given)),
        }
    }

    /// The store for people and logs: the path, or the URL without its password.
    pub fn describe(&self) -> String {
        match self {
            Self::Sqlite(path) => path.display().to_string(),
            Self::Postgres(url) => redact_url(url.expose()),
        }
    }

    /// Opens the store as [`Self::open`] does, with its lease when it is
    /// PostgreSQL: every server on one database is a replica. Blocks.
    pub fn open_replicated(&self, key: &SealKey) -> Result<Opened, StoreError> {
        Ok(match self {
            Self::Sqlite(path) => Opened { store: Arc::new(SqliteStore::open(path, key)?), lease: None },
            Self::Postgres(url) => {
                let store = Arc::new(PostgresStore::connect(url, key)?);
                Opened { store: Arc::clone(&store) as Arc<dyn Store>, lease: Some(store) }
            }
        })
    }

    /// Opens the store (creating or migrating it as needed); run requests
    /// are sealed with `key`. Blocks: call it off the async threads.
    pub fn open(&self, key: &SealKey) -> Result<Arc<dyn Store>, StoreError> {
        Ok(match self {
            Self::Sqlite(path) => Arc::new(SqliteStore::open(path, key)?),
            Self::Postgres(url) => Arc::new(PostgresStore::connect(url, key)?),
        })
    }
}

/// `'exited', 'failed', 'cancelled'`: the finished states, for SQL.
fn terminal_states() -> String {
    let states: Vec<String> =
        RunState::ALL.into_iter().filter(|state| state.is_terminal()).map(|state| format!("'{state}'")).collect();
    states.join(", ")
}

/// A row of the finished-run counts: its state and its last attempt's path
/// as stored; `None` for a state or path this version does not know.
fn finished_key(state: &str, path: Option<&str>) -> Option<(RunState, Option<RunPath>)> {
    let state = RunState::ALL.into_iter().find(|known| known.as_str() == state)?;
    match path {
        None => Some((state, None)),
        Some(path) => RunPath::ALL.into_iter().find(|known| known.as_str() == path).map(|path| (state, Some(path))),
    }
}

fn to_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

fn to_u64(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

fn encode(value: &impl Serialize) -> String {
    // The records hold strings, numbers, maps and lists only.
    serde_json::to_string(value).unwrap_or_default()
}

fn decode<T: DeserializeOwned>(store: &str, table: &'static str, id: &str, doc: &str) -> Result<T, StoreError> {
    serde_json::from_str(doc).map_err(|error| StoreError::Corrupt {
        store: store.to_owned(),
        table,
        id: id.to_owned(),
        problem: standby_protocol::describe_json_error(&error),
    })
}

/// Opens a run's sealed request: it opens only with this key and only as
/// this run's.
fn open_request(sealer: &Sealer, store: &str, run_id: &str, sealed: &str) -> Result<RunRequest, StoreError> {
    let corrupt = |problem: String| StoreError::Corrupt {
        store: store.to_owned(),
        table: "run_requests",
        id: run_id.to_owned(),
        problem,
    };
    let plain = sealer.open(run_id, sealed).map_err(|error| corrupt(error.to_string()))?;
    let text = String::from_utf8(plain).map_err(|_| corrupt("the opened record is not UTF-8".into()))?;
    decode(store, "run_requests", run_id, &text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_postgres_url_selects_postgres_and_anything_else_a_sqlite_file() {
        let data = Path::new("data");
        assert_eq!(StoreLocation::from_arg(None, data), StoreLocation::Sqlite(data.join("standby.db")));
        assert_eq!(StoreLocation::from_arg(Some("x/s.db".into()), data), StoreLocation::Sqlite("x/s.db".into()));
        for url in ["postgres://u:pw@db/standby", "postgresql://db/standby"] {
            assert_eq!(StoreLocation::from_arg(Some(url.into()), data), StoreLocation::Postgres(Secret::new(url)));
        }
        // A file whose name merely starts like a scheme is a file.
        assert_eq!(StoreLocation::from_arg(Some("postgres".into()), data), StoreLocation::Sqlite("postgres".into()));
    }

    #[test]
    fn a_locations_description_and_debug_hide_the_password() {
        let location = StoreLocation::Postgres(Secret::new("postgres://standby:hunter2@db:5432/standby"));
        assert_eq!(location.describe(), "postgres://standby:[REDACTED]@db:5432/standby");
        assert!(!format!("{location:?}").contains("hunter2"));
    }

    #[test]
    fn finished_keys_read_known_states_and_paths_only() {
        assert_eq!(finished_key("exited", Some("warm")), Some((RunState::Exited, Some(RunPath::Warm))));
        assert_eq!(finished_key("cancelled", None), Some((RunState::Cancelled, None)));
        assert_eq!(finished_key("vanished", None), None);
        assert_eq!(finished_key("failed", Some("teleported")), None);
    }
}
