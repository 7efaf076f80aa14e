//! Durable records behind a trait, and the default implementation: an
//! embedded SQLite file (WAL, `synchronous=FULL`), no external service.
//!
//! Records are kept as JSON documents keyed by id; a [`Step`]'s writes are
//! applied in one transaction, so a crash leaves either all of a decision
//! or none of it. Thread pointers are written compare-and-set on their
//! generation: a write that expected another generation (a stale writer,
//! such as a second server on the same file) fails the whole transaction. Credentials are stored only as hashes (see
//! [`crate::credential`]). What a run was submitted with (secrets, cloud
//! env, git passwords, attachments, metadata) must be served to its agent,
//! so it is kept, but only sealed ([`crate::seal`], bound to the run id),
//! and deleted in the transaction that makes the run terminal: after that
//! nothing may fetch it. Deleted rows are overwritten (`secure_delete`).
//!
//! The file and its `-wal`/`-shm` companions are mode 0600 whatever the
//! umask (SQLite gives the companions the database file's mode), and a
//! directory made for it is 0700.
//!
//! Calls block; the engine runs them on the blocking pool.
//!
//! [`Step`]: crate::dispatch::Step

use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use rusqlite::{Connection, OptionalExtension, params};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::dispatch::{Snapshot, Write};
use crate::model::{CredentialRecord, RunRecord, RunRequest, RunState, SandboxRecord, StoredEvent, ThreadRecord};
use crate::seal::{SealKey, Sealer};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store {path}: {operation}: {source}")]
    Sqlite {
        path: String,
        operation: &'static str,
        #[source]
        source: rusqlite::Error,
    },
    #[error("store {path}: record `{id}` in `{table}` is unreadable: {problem}")]
    Corrupt { path: String, table: &'static str, id: String, problem: String },
    #[error(
        "store {path}: thread `{thread_id}` pointer expected at generation {expected} is at {found}: another writer moved it"
    )]
    StalePointer { path: String, thread_id: String, expected: u64, found: u64 },
    #[error("store {path}: cannot create the directory {dir}: {source}")]
    Directory {
        path: String,
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("store {path}: cannot make {file} readable by its owner only: {source}")]
    Permissions {
        path: String,
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Where the server keeps runs, sandboxes, credentials, events and logs.
pub trait Store: Send + Sync + 'static {
    /// Everything the dispatch state machine needs after a restart.
    fn load(&self) -> Result<Snapshot, StoreError>;
    /// Applies `writes` in one transaction: all or nothing.
    fn apply(&self, writes: &[Write]) -> Result<(), StoreError>;
    /// What a run was submitted with (secrets included); `None` once the
    /// run is terminal: a write of a terminal run deletes it in the same
    /// transaction.
    fn request(&self, run_id: &str) -> Result<Option<RunRequest>, StoreError>;
    /// The run's events, in arrival order.
    fn events(&self, run_id: &str) -> Result<Vec<StoredEvent>, StoreError>;
    /// The run's log as received (redacted by the agent).
    fn log(&self, run_id: &str) -> Result<Vec<u8>, StoreError>;
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS runs (id TEXT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS run_requests (run_id TEXT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sandboxes (id TEXT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS credentials (id TEXT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL,
    event_id TEXT NOT NULL,
    doc TEXT NOT NULL,
    UNIQUE (run_id, event_id)
);
CREATE TABLE IF NOT EXISTS threads (id TEXT PRIMARY KEY, generation INTEGER NOT NULL, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS log_chunks (
    run_id TEXT NOT NULL,
    start INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (run_id, start)
);
";

/// The SQLite [`Store`].
#[derive(Debug)]
pub struct SqliteStore {
    path: String,
    connection: Mutex<Connection>,
    sealer: Sealer,
}

impl SqliteStore {
    /// Opens (creating if needed) the store file at `path`; run requests
    /// are sealed with `key`.
    pub fn open(path: &Path, key: &SealKey) -> Result<Self, StoreError> {
        let name = path.display().to_string();
        if let Some(dir) = path.parent().filter(|dir| !dir.as_os_str().is_empty()) {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|source| StoreError::Directory { path: name.clone(), dir: dir.to_owned(), source })?;
        }
        // Created owner-only before SQLite opens it, and tightened if it
        // already existed.
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(path)
            .and_then(|file| file.set_permissions(std::fs::Permissions::from_mode(0o600)))
            .map_err(|source| StoreError::Permissions { path: name.clone(), file: path.to_owned(), source })?;
        let connection = Connection::open(path).map_err(|source| sqlite(&name, "open", source))?;
        let store = Self::init(name, connection, key)?;
        // Companions left by an earlier run of the server keep their old
        // mode until SQLite recreates them: tighten them too.
        for suffix in ["-wal", "-shm"] {
            let companion = PathBuf::from(format!("{}{suffix}", path.display()));
            match std::fs::set_permissions(&companion, std::fs::Permissions::from_mode(0o600)) {
                Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                    return Err(StoreError::Permissions { path: store.path.clone(), file: companion, source: error });
                }
                _ => {}
            }
        }
        Ok(store)
    }

    /// A store that lives only as long as the process (tests, the demo),
    /// sealing with a key of its own.
    pub fn in_memory() -> Result<Self, StoreError> {
        let connection = Connection::open_in_memory().map_err(|source| sqlite(":memory:", "open", source))?;
        Self::init(":memory:".into(), connection, &SealKey::random())
    }

    fn init(path: String, connection: Connection, key: &SealKey) -> Result<Self, StoreError> {
        // WAL: readers do not block the writer and a crash mid-write
        // leaves the last committed state; FULL: a committed transaction
        // survives a power loss too; secure_delete: a purged request's
        // bytes are overwritten, not left on a free page.
        connection
            .execute_batch(
                "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL; PRAGMA busy_timeout = 5000; \
                 PRAGMA secure_delete = ON;",
            )
            .map_err(|source| sqlite(&path, "configure", source))?;
        connection.execute_batch(SCHEMA).map_err(|source| sqlite(&path, "create the schema", source))?;
        let store = Self { path, connection: Mutex::new(connection), sealer: Sealer::new(key) };
        store.seal_legacy_requests()?;
        Ok(store)
    }

    /// Brings a file written by an earlier version up to the rules: the
    /// requests of terminal runs deleted, the others sealed, and the
    /// write-ahead log emptied so no plain copy stays in it.
    fn seal_legacy_requests(&self) -> Result<(), StoreError> {
        let mut connection = self.connection();
        let write = |source| sqlite(&self.path, "seal the stored requests", source);
        let transaction = connection.transaction().map_err(write)?;
        let terminal: Vec<String> =
            RunState::ALL.into_iter().filter(|state| state.is_terminal()).map(|state| encode(&state)).collect();
        let mut purged = 0;
        for state in &terminal {
            purged += transaction
                .execute(
                    "DELETE FROM run_requests WHERE run_id IN \
                     (SELECT id FROM runs WHERE json_quote(json_extract(doc, '$.state')) = ?1)",
                    [state],
                )
                .map_err(write)?;
        }
        let plain: Vec<(String, String)> = {
            let mut statement = transaction.prepare("SELECT run_id, doc FROM run_requests").map_err(write)?;
            let rows = statement
                .query_map([], |row| Ok((row.get::<_, String>(0)?, row.get::<_, String>(1)?)))
                .map_err(write)?
                .collect::<Result<Vec<_>, _>>()
                .map_err(write)?;
            rows.into_iter().filter(|(_, doc)| !Sealer::is_sealed(doc)).collect()
        };
        for (run_id, doc) in &plain {
            let sealed = self.sealer.seal(run_id, doc.as_bytes());
            transaction
                .execute("UPDATE run_requests SET doc = ?2 WHERE run_id = ?1", params![run_id, sealed])
                .map_err(write)?;
        }
        transaction.commit().map_err(write)?;
        if purged + plain.len() > 0 {
            tracing::info!(
                path = self.path,
                purged,
                sealed = plain.len(),
                "stored run requests of an earlier version: terminal ones deleted, the others sealed"
            );
            connection.execute_batch("PRAGMA wal_checkpoint(TRUNCATE);").map_err(write)?;
        }
        Ok(())
    }

    fn connection(&self) -> std::sync::MutexGuard<'_, Connection> {
        // A panic while holding the lock cannot leave a transaction open:
        // rusqlite rolls back an unfinished transaction when it is dropped.
        self.connection.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn docs<T: DeserializeOwned>(&self, connection: &Connection, table: &'static str) -> Result<Vec<T>, StoreError> {
        let sql = format!("SELECT id, doc FROM {table} ORDER BY id");
        let mut statement = connection.prepare(&sql).map_err(|source| sqlite(&self.path, "read", source))?;
        let rows = statement
            .query_map([], |row| Ok((row.get::<_, String>(0)?, row.get::<_, String>(1)?)))
            .map_err(|source| sqlite(&self.path, "read", source))?;
        let mut docs = Vec::new();
        for row in rows {
            let (id, doc) = row.map_err(|source| sqlite(&self.path, "read", source))?;
            docs.push(self.decode(table, &id, &doc)?);
        }
        Ok(docs)
    }

    fn decode<T: DeserializeOwned>(&self, table: &'static str, id: &str, doc: &str) -> Result<T, StoreError> {
        serde_json::from_str(doc).map_err(|error| StoreError::Corrupt {
            path: self.path.clone(),
            table,
            id: id.to_owned(),
            problem: standby_protocol::describe_json_error(&error),
        })
    }
}

fn sqlite(path: &str, operation: &'static str, source: rusqlite::Error) -> StoreError {
    StoreError::Sqlite { path: path.to_owned(), operation, source }
}

fn encode(value: &impl Serialize) -> String {
    // The records hold strings, numbers, maps and lists only.
    serde_json::to_string(value).unwrap_or_default()
}

impl Store for SqliteStore {
    fn load(&self) -> Result<Snapshot, StoreError> {
        let connection = self.connection();
        let runs: Vec<RunRecord> = self.docs(&connection, "runs")?;
        let sandboxes: Vec<SandboxRecord> = self.docs(&connection, "sandboxes")?;
        let credentials: Vec<CredentialRecord> = self.docs(&connection, "credentials")?;
        let threads: Vec<ThreadRecord> = self.docs(&connection, "threads")?;
        let read = |source| sqlite(&self.path, "read", source);
        let mut statement = connection.prepare("SELECT run_id, event_id FROM events ORDER BY seq").map_err(read)?;
        let event_ids = statement
            .query_map([], |row| Ok((row.get::<_, String>(0)?, row.get::<_, String>(1)?)))
            .map_err(read)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(read)?;
        let mut statement =
            connection.prepare("SELECT run_id, SUM(LENGTH(data)) FROM log_chunks GROUP BY run_id").map_err(read)?;
        let log_lengths = statement
            .query_map([], |row| Ok((row.get::<_, String>(0)?, row.get::<_, i64>(1)?)))
            .map_err(read)?
            .map(|row| row.map(|(run, len)| (run, u64::try_from(len).unwrap_or(0))))
            .collect::<Result<Vec<_>, _>>()
            .map_err(read)?;
        Ok(Snapshot { runs, sandboxes, credentials, event_ids, log_lengths, threads })
    }

    fn apply(&self, writes: &[Write]) -> Result<(), StoreError> {
        if writes.is_empty() {
            return Ok(());
        }
        let mut connection = self.connection();
        let write = |source| sqlite(&self.path, "write", source);
        let transaction = connection.transaction().map_err(write)?;
        for change in writes {
            match change {
                Write::NewRun(run, request) => {
                    // A run refused at birth (terminal already) keeps nothing.
                    if !run.state.is_terminal() {
                        let sealed = self.sealer.seal(&run.id, encode(request).as_bytes());
                        transaction
                            .execute("INSERT INTO run_requests (run_id, doc) VALUES (?1, ?2)", params![run.id, sealed])
                            .map_err(write)?;
                    }
                    transaction
                        .execute("INSERT INTO runs (id, doc) VALUES (?1, ?2)", params![run.id, encode(run)])
                        .map_err(write)?;
                }
                Write::Run(run) => write_run(&transaction, run).map_err(write)?,
                Write::Sandbox(sandbox) => {
                    upsert(&transaction, "sandboxes", &sandbox.id, &encode(sandbox)).map_err(write)?
                }
                Write::Credential(credential) => {
                    upsert(&transaction, "credentials", &credential.id, &encode(credential)).map_err(write)?;
                }
                Write::Event(event) => {
                    transaction
                        .execute(
                            "INSERT OR IGNORE INTO events (run_id, event_id, doc) VALUES (?1, ?2, ?3)",
                            params![event.run_id, event.event.event_id, encode(event)],
                        )
                        .map_err(write)?;
                }
                Write::Log { run_id, offset, data } => {
                    let start = i64::try_from(*offset).unwrap_or(i64::MAX);
                    transaction
                        .execute(
                            "INSERT INTO log_chunks (run_id, start, data) VALUES (?1, ?2, ?3)",
                            params![run_id, start, data],
                        )
                        .map_err(write)?;
                }
                Write::Thread { record, expected } => self.write_thread(&transaction, record, *expected)?,
            }
        }
        transaction.commit().map_err(|source| sqlite(&self.path, "commit", source))
    }

    fn request(&self, run_id: &str) -> Result<Option<RunRequest>, StoreError> {
        let connection = self.connection();
        let doc: Option<String> = connection
            .query_row("SELECT doc FROM run_requests WHERE run_id = ?1", [run_id], |row| row.get(0))
            .optional()
            .map_err(|source| sqlite(&self.path, "read", source))?;
        let Some(doc) = doc else { return Ok(None) };
        if !Sealer::is_sealed(&doc) {
            // Only an earlier version's server on the same file writes
            // plain requests; the next open seals them.
            return self.decode("run_requests", run_id, &doc).map(Some);
        }
        let plain = self.sealer.open(run_id, &doc).map_err(|error| StoreError::Corrupt {
            path: self.path.clone(),
            table: "run_requests",
            id: run_id.to_owned(),
            problem: error.to_string(),
        })?;
        let text = String::from_utf8(plain).map_err(|_| StoreError::Corrupt {
            path: self.path.clone(),
            table: "run_requests",
            id: run_id.to_owned(),
            problem: "the opened record is not UTF-8".into(),
        })?;
        self.decode("run_requests", run_id, &text).map(Some)
    }

    fn events(&self, run_id: &str) -> Result<Vec<StoredEvent>, StoreError> {
        let connection = self.connection();
        let read = |source| sqlite(&self.path, "read", source);
        let mut statement =
            connection.prepare("SELECT event_id, doc FROM events WHERE run_id = ?1 ORDER BY seq").map_err(read)?;
        let rows = statement
            .query_map([run_id], |row| Ok((row.get::<_, String>(0)?, row.get::<_, String>(1)?)))
            .map_err(read)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(read)?;
        rows.iter().map(|(id, doc)| self.decode("events", id, doc)).collect()
    }

    fn log(&self, run_id: &str) -> Result<Vec<u8>, StoreError> {
        let connection = self.connection();
        let read = |source| sqlite(&self.path, "read", source);
        let mut statement =
            connection.prepare("SELECT data FROM log_chunks WHERE run_id = ?1 ORDER BY start").map_err(read)?;
        let chunks = statement
            .query_map([run_id], |row| row.get::<_, Vec<u8>>(0))
            .map_err(read)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(read)?;
        Ok(chunks.concat())
    }
}

impl SqliteStore {
    /// Compare-and-set: the row must be at `expected` (absent for `0`).
    /// Dropping the transaction on the error rolls back the whole step.
    fn write_thread(
        &self,
        transaction: &rusqlite::Transaction<'_>,
        record: &ThreadRecord,
        expected: u64,
    ) -> Result<(), StoreError> {
        let write = |source| sqlite(&self.path, "write", source);
        let generation = |g: u64| i64::try_from(g).unwrap_or(i64::MAX);
        let changed = if expected == 0 {
            transaction
                .execute(
                    "INSERT INTO threads (id, generation, doc) VALUES (?1, ?2, ?3) ON CONFLICT (id) DO NOTHING",
                    params![record.id, generation(record.generation), encode(record)],
                )
                .map_err(write)?
        } else {
            transaction
                .execute(
                    "UPDATE threads SET generation = ?2, doc = ?3 WHERE id = ?1 AND generation = ?4",
                    params![record.id, generation(record.generation), encode(record), generation(expected)],
                )
                .map_err(write)?
        };
        if changed == 1 {
            return Ok(());
        }
        let found: Option<i64> = transaction
            .query_row("SELECT generation FROM threads WHERE id = ?1", [&record.id], |row| row.get(0))
            .optional()
            .map_err(write)?;
        Err(StoreError::StalePointer {
            path: self.path.clone(),
            thread_id: record.id.clone(),
            expected,
            found: found.and_then(|g| u64::try_from(g).ok()).unwrap_or(0),
        })
    }
}

/// Writes a run; a terminal run's request is deleted with it: it was
/// needed only by the agent, and no agent of a finished run may fetch it.
fn write_run(transaction: &rusqlite::Transaction<'_>, run: &RunRecord) -> rusqlite::Result<()> {
    upsert(transaction, "runs", &run.id, &encode(run))?;
    if run.state.is_terminal() {
        transaction.execute("DELETE FROM run_requests WHERE run_id = ?1", [&run.id])?;
    }
    Ok(())
}

fn upsert(transaction: &rusqlite::Transaction<'_>, table: &str, id: &str, doc: &str) -> rusqlite::Result<()> {
    let sql =
        format!("INSERT INTO {table} (id, doc) VALUES (?1, ?2) ON CONFLICT (id) DO UPDATE SET doc = excluded.doc");
    transaction.execute(&sql, params![id, doc]).map(|_| ())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use standby_protocol::{Event, EventKind, Run, Secret, Workspace, fingerprint};

    use super::*;
    use crate::credential::{CredentialKind, TokenHash};
    use crate::model::{CredentialState, Millis, RunState};

    fn run(id: &str) -> RunRecord {
        RunRecord {
            id: id.into(),
            submitted_at: Millis(5),
            state: RunState::Queued,
            run: Run {
                command: vec!["true".into()],
                cwd: None,
                env: BTreeMap::new(),
                mcp_env: BTreeMap::new(),
                workspace: Some(Workspace::default()),
                strict_mcp: true,
                attachments: None,
            },
            fingerprint: Some(fingerprint(&Workspace::default())),
            attempts: Vec::new(),
            exit_code: None,
            error: None,
            ended_at: None,
            thread_id: None,
            thread_generation: None,
            wait: None,
            resume: None,
        }
    }

    /// One key for the whole test binary, so a reopened file opens.
    fn key() -> SealKey {
        static KEY: std::sync::OnceLock<SealKey> = std::sync::OnceLock::new();
        KEY.get_or_init(SealKey::random).clone()
    }

    fn request() -> RunRequest {
        RunRequest {
            secrets: BTreeMap::from([("TOKEN".into(), Secret::new("s3cret"))]),
            cloud_env: BTreeMap::new(),
            git_credentials: Vec::new(),
            metadata: serde_json::json!({"ticket": 7}),
            attachments: Vec::new(),
        }
    }

    #[test]
    fn records_survive_reopening_the_file() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("nested").join("standby.db");
        let credential = CredentialRecord {
            id: "c1".into(),
            kind: CredentialKind::Standby,
            hash: TokenHash::of("sby_c1_x"),
            sandbox_id: "sbx_1".into(),
            run_id: None,
            attempt: None,
            state: CredentialState::Active,
        };
        {
            let store = SqliteStore::open(&path, &key()).expect("open");
            let mut updated = run("exe_1");
            updated.state = RunState::Running;
            let event = StoredEvent {
                run_id: "exe_1".into(),
                attempt: 1,
                received_at: Millis(9),
                event: Event { event_id: "e1".into(), kind: EventKind::Exited { code: 4 } },
            };
            store
                .apply(&[
                    Write::NewRun(Box::new(run("exe_1")), Box::new(request())),
                    Write::Credential(Box::new(credential.clone())),
                    Write::Run(Box::new(updated)),
                    Write::Event(Box::new(event.clone())),
                    Write::Event(Box::new(event)),
                    Write::Log { run_id: "exe_1".into(), offset: 0, data: b"hel".to_vec() },
                    Write::Log { run_id: "exe_1".into(), offset: 3, data: b"lo".to_vec() },
                ])
                .expect("apply");
        }
        let store = SqliteStore::open(&path, &key()).expect("reopen");
        let snapshot = store.load().expect("load");
        assert_eq!(snapshot.runs.len(), 1);
        assert_eq!(snapshot.runs[0].state, RunState::Running);
        assert_eq!(snapshot.credentials, [credential]);
        assert_eq!(snapshot.event_ids, [("exe_1".to_owned(), "e1".to_owned())]);
        assert_eq!(snapshot.log_lengths, [("exe_1".to_owned(), 5)]);
        assert_eq!(store.log("exe_1").expect("log"), b"hello");
        assert_eq!(store.request("exe_1").expect("request"), Some(request()));
        assert_eq!(store.events("exe_1").expect("events").len(), 1);
        assert_eq!(store.request("exe_2").expect("request"), None);
    }

    #[test]
    fn a_failing_write_leaves_nothing_half_written() {
        let store = SqliteStore::in_memory().expect("open");
        store.apply(&[Write::NewRun(Box::new(run("exe_1")), Box::new(request()))]).expect("apply");
        let mut changed = run("exe_1");
        changed.state = RunState::Failed;
        // The second NewRun of the same id violates the primary key.
        let error = store
            .apply(&[Write::Run(Box::new(changed)), Write::NewRun(Box::new(run("exe_1")), Box::new(request()))])
            .expect_err("a duplicate run is refused");
        assert!(error.to_string().contains("write"), "{error}");
        assert_eq!(store.load().expect("load").runs[0].state, RunState::Queued, "the first write was rolled back");
    }

    fn pointer(generation: u64, sandbox_id: &str) -> ThreadRecord {
        ThreadRecord {
            id: "thr_1".into(),
            generation,
            sandbox_id: Some(sandbox_id.into()),
            holder: None,
            updated_at: Millis(generation as i64),
        }
    }

    /// Two servers on one file: the one that read an older generation of
    /// the pointer cannot overwrite the newer one, and nothing else of its
    /// step is written either.
    #[test]
    fn a_stale_pointer_write_is_rejected_with_its_whole_step() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("standby.db");
        let first = SqliteStore::open(&path, &key()).expect("open");
        let second = SqliteStore::open(&path, &key()).expect("open again");
        first.apply(&[Write::Thread { record: Box::new(pointer(1, "sbx_a")), expected: 0 }]).expect("created");
        // Both read generation 1; the first writer wins.
        first.apply(&[Write::Thread { record: Box::new(pointer(2, "sbx_b")), expected: 1 }]).expect("moved on");
        let error = second
            .apply(&[
                Write::NewRun(Box::new(run("exe_late")), Box::new(request())),
                Write::Thread { record: Box::new(pointer(2, "sbx_stale")), expected: 1 },
            ])
            .expect_err("a stale writer is refused");
        assert!(
            matches!(&error, StoreError::StalePointer { expected: 1, found: 2, thread_id, .. } if thread_id == "thr_1"),
            "{error}"
        );
        let snapshot = second.load().expect("load");
        assert_eq!(snapshot.threads, [pointer(2, "sbx_b")], "the newer pointer stands");
        assert!(snapshot.runs.is_empty(), "the stale step left nothing behind");
        // Creating a pointer that exists is stale too.
        let error = second
            .apply(&[Write::Thread { record: Box::new(pointer(1, "sbx_c")), expected: 0 }])
            .expect_err("already created");
        assert!(matches!(error, StoreError::StalePointer { expected: 0, found: 2, .. }), "{error}");
    }

    #[test]
    fn credentials_are_stored_as_hashes() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("standby.db");
        let store = SqliteStore::open(&path, &key()).expect("open");
        let token = "sby_c9_averyrecognisablesecret";
        let credential = CredentialRecord {
            id: "c9".into(),
            kind: CredentialKind::Standby,
            hash: TokenHash::of(token),
            sandbox_id: "sbx_1".into(),
            run_id: None,
            attempt: None,
            state: CredentialState::Active,
        };
        store.apply(&[Write::Credential(Box::new(credential))]).expect("apply");
        drop(store);
        let mut bytes = std::fs::read(&path).expect("read the file");
        for suffix in ["-wal", "-shm"] {
            bytes.extend(std::fs::read(format!("{}{suffix}", path.display())).unwrap_or_default());
        }
        let text = String::from_utf8_lossy(&bytes);
        assert!(!text.contains("averyrecognisablesecret"));
    }

    /// Every byte SQLite keeps for the store at `path`.
    fn raw_bytes(path: &Path) -> Vec<u8> {
        let mut bytes = std::fs::read(path).expect("read the file");
        for suffix in ["-wal", "-shm"] {
            bytes.extend(std::fs::read(format!("{}{suffix}", path.display())).unwrap_or_default());
        }
        bytes
    }

    fn contains(haystack: &[u8], needle: &str) -> bool {
        haystack.windows(needle.len()).any(|window| window == needle.as_bytes())
    }

    /// What is given with a run, each value recognisable in raw bytes.
    fn full_request() -> (RunRequest, Vec<&'static str>) {
        let values = vec![
            "secret-value-7f3a",
            "cloud-value-c91e",
            "git-password-5d2b",
            "attachment-content-88aa",
            "metadata-value-4e0f",
        ];
        let attachment = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, values[3]);
        let request = RunRequest {
            secrets: BTreeMap::from([("TOKEN".into(), Secret::new(values[0]))]),
            cloud_env: BTreeMap::from([("AWS_SECRET".into(), Secret::new(values[1]))]),
            git_credentials: vec![standby_protocol::GitCredential {
                protocol: "https".into(),
                host: "git.example".into(),
                username: "bot".into(),
                password: Secret::new(values[2]),
            }],
            metadata: serde_json::json!({"ticket": values[4]}),
            attachments: vec![crate::model::StoredAttachment {
                name: "a.txt".into(),
                content_base64: attachment.clone(),
                sha256: "0".repeat(64),
            }],
        };
        // The attachment is stored base64: look for that form too.
        let mut needles = values;
        needles.push(Box::leak(attachment.into_boxed_str()));
        (request, needles)
    }

    #[test]
    fn requests_are_sealed_at_rest_and_purged_when_the_run_ends() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("standby.db");
        let store = SqliteStore::open(&path, &key()).expect("open");
        let (request, needles) = full_request();
        store.apply(&[Write::NewRun(Box::new(run("exe_1")), Box::new(request.clone()))]).expect("apply");
        assert_eq!(store.request("exe_1").expect("read"), Some(request), "served while the run lives");
        let bytes = raw_bytes(&path);
        for needle in &needles {
            assert!(!contains(&bytes, needle), "`{needle}` is sealed, never in clear");
        }
        assert!(contains(&bytes, "sealed1:"), "the request is stored, sealed");

        let mut ended = run("exe_1");
        ended.state = RunState::Exited;
        store.apply(&[Write::Run(Box::new(ended))]).expect("apply");
        assert_eq!(store.request("exe_1").expect("read"), None, "purged with the terminal state");
        drop(store);
        let store = SqliteStore::open(&path, &key()).expect("reopen");
        assert_eq!(store.load().expect("load").runs[0].state, RunState::Exited);
        assert_eq!(store.request("exe_1").expect("read"), None);
        let bytes = raw_bytes(&path);
        for needle in &needles {
            assert!(!contains(&bytes, needle), "`{needle}` is nowhere after the purge");
        }
    }

    /// A sealed request copied onto another run's row does not open: the
    /// run id is its associated data.
    #[test]
    fn a_sealed_request_cannot_be_moved_to_another_run() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("standby.db");
        let store = SqliteStore::open(&path, &key()).expect("open");
        let (request, _) = full_request();
        store
            .apply(&[
                Write::NewRun(Box::new(run("exe_1")), Box::new(request)),
                Write::NewRun(Box::new(run("exe_2")), Box::new(super::tests::request())),
            ])
            .expect("apply");
        store
            .connection()
            .execute("UPDATE run_requests SET doc = (SELECT doc FROM run_requests WHERE run_id = 'exe_1') WHERE run_id = 'exe_2'", [])
            .expect("moved");
        let error = store.request("exe_2").expect_err("does not open as another run's");
        assert!(matches!(&error, StoreError::Corrupt { id, .. } if id == "exe_2"), "{error}");
        assert!(store.request("exe_1").is_ok());
        let other_key = SqliteStore::open(&path, &SealKey::random()).expect("open with another key");
        assert!(other_key.request("exe_1").is_err(), "another key does not open it either");
    }

    #[test]
    fn the_store_is_readable_by_its_owner_only() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("data").join("standby.db");
        let store = SqliteStore::open(&path, &key()).expect("open");
        store.apply(&[Write::NewRun(Box::new(run("exe_1")), Box::new(request()))]).expect("apply");
        let mode = |path: &Path| std::fs::metadata(path).expect("exists").permissions().mode() & 0o777;
        assert_eq!(mode(path.parent().expect("a parent")), 0o700, "the directory made for it");
        for suffix in ["", "-wal", "-shm"] {
            assert_eq!(mode(Path::new(&format!("{}{suffix}", path.display()))), 0o600, "standby.db{suffix}");
        }
        drop(store);
        // An existing file left readable (an earlier version) is tightened.
        for suffix in ["", "-wal", "-shm"] {
            let file = format!("{}{suffix}", path.display());
            if Path::new(&file).exists() {
                std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).expect("chmod");
            }
        }
        let _store = SqliteStore::open(&path, &key()).expect("reopen");
        for suffix in ["", "-wal", "-shm"] {
            let file = format!("{}{suffix}", path.display());
            if Path::new(&file).exists() {
                assert_eq!(mode(Path::new(&file)), 0o600, "standby.db{suffix} after reopening");
            }
        }
    }

    /// A file from before sealing: the terminal run's request is deleted,
    /// the live one's sealed, and no plain copy is left in any file.
    #[test]
    fn an_earlier_versions_plain_requests_are_sealed_or_purged_on_open() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("standby.db");
        let (live, needles) = full_request();
        let mut ended = run("exe_ended");
        ended.state = RunState::Failed;
        {
            let connection = Connection::open(&path).expect("open");
            connection.execute_batch("PRAGMA journal_mode = WAL;").expect("wal");
            connection.execute_batch(SCHEMA).expect("schema");
            for (record, request) in [(run("exe_live"), &live), (ended, &live)] {
                connection
                    .execute("INSERT INTO runs (id, doc) VALUES (?1, ?2)", params![record.id, encode(&record)])
                    .expect("run");
                connection
                    .execute(
                        "INSERT INTO run_requests (run_id, doc) VALUES (?1, ?2)",
                        params![record.id, encode(request)],
                    )
                    .expect("request");
            }
        }
        assert!(contains(&raw_bytes(&path), needles[0]), "the old version kept it in clear");
        let store = SqliteStore::open(&path, &key()).expect("open");
        assert_eq!(store.request("exe_live").expect("read"), Some(live));
        assert_eq!(store.request("exe_ended").expect("read"), None);
        let bytes = raw_bytes(&path);
        for needle in &needles {
            assert!(!contains(&bytes, needle), "`{needle}` is not in clear any more");
        }
    }
}
