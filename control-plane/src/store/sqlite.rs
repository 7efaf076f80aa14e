//! The SQLite [`Store`]: an embedded file (WAL, `synchronous=FULL`), no
//! external service; the default. Deleted rows are overwritten
//! (`secure_delete`), so a purged request leaves no bytes on a free page.
//!
//! The file and its `-wal`/`-shm` companions are mode 0600 whatever the
//! umask (SQLite gives the companions the database file's mode), and a
//! directory made for it is 0700. A file written by an earlier version is
//! brought up to the rules on open: the run columns added, plain requests
//! sealed or purged.

use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use rusqlite::{Connection, OptionalExtension, params};
use serde::de::DeserializeOwned;

use super::{
    Fence, RunQuery, Store, StoreError, decode, encode, finished_key, open_request, terminal_states, to_i64, to_u64,
};
use crate::model::{
    CredentialRecord, IdempotencyRecord, RunRecord, RunRequest, RunState, SandboxRecord, StoredEvent, ThreadRecord,
};
use crate::rules::{LogLedger, Snapshot, Write};
use crate::seal::{SealKey, Sealer};

/// Columns of `runs` read from its document, indexed for paging and for
/// loading only unfinished runs: added to stores created before them.
const RUN_COLUMNS: [(&str, &str); 3] = [
    ("submitted_at", "json_extract(doc, '$.submitted_at')"),
    ("state", "json_extract(doc, '$.state')"),
    ("thread_id", "json_extract(doc, '$.thread_id')"),
];

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
CREATE TABLE IF NOT EXISTS log_ledgers (
    run_id TEXT PRIMARY KEY,
    received INTEGER NOT NULL,
    held INTEGER NOT NULL,
    over_cap INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS idempotency_keys (id TEXT PRIMARY KEY, created_at INTEGER NOT NULL, doc TEXT NOT NULL);
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
                .map_err(|source| StoreError::Directory { store: name.clone(), dir: dir.to_owned(), source })?;
        }
        // Created owner-only before SQLite opens it, and tightened if it
        // already existed.
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(path)
            .and_then(|file| file.set_permissions(std::fs::Permissions::from_mode(0o600)))
            .map_err(|source| StoreError::Permissions { store: name.clone(), file: path.to_owned(), source })?;
        let connection = Connection::open(path).map_err(|source| sqlite(&name, "open", source))?;
        let store = Self::init(name, connection, key)?;
        // Companions left by an earlier run of the server keep their old
        // mode until SQLite recreates them: tighten them too.
        for suffix in ["-wal", "-shm"] {
            let companion = PathBuf::from(format!("{}{suffix}", path.display()));
            match std::fs::set_permissions(&companion, std::fs::Permissions::from_mode(0o600)) {
                Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                    return Err(StoreError::Permissions { store: store.path.clone(), file: companion, source: error });
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
        add_run_columns(&connection).map_err(|source| sqlite(&path, "add the run columns", source))?;
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

    fn query_docs<T: DeserializeOwned>(
        &self,
        connection: &Connection,
        table: &'static str,
        sql: &str,
        params: impl rusqlite::Params,
    ) -> Result<Vec<T>, StoreError> {
        let read = |source| sqlite(&self.path, "read", source);
        let mut statement = connection.prepare(sql).map_err(read)?;
        let rows = statement
            .query_map(params, |row| Ok((row.get::<_, String>(0)?, row.get::<_, String>(1)?)))
            .map_err(read)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(read)?;
        rows.iter().map(|(id, doc)| self.decode(table, id, doc)).collect()
    }

    fn decode<T: DeserializeOwned>(&self, table: &'static str, id: &str, doc: &str) -> Result<T, StoreError> {
        decode(&self.path, table, id, doc)
    }
}

fn add_run_columns(connection: &Connection) -> rusqlite::Result<()> {
    let mut statement = connection.prepare("SELECT name FROM pragma_table_xinfo('runs')")?;
    let present = statement.query_map([], |row| row.get::<_, String>(0))?.collect::<Result<Vec<_>, _>>()?;
    for (name, expression) in RUN_COLUMNS {
        if !present.iter().any(|column| column == name) {
            connection.execute_batch(&format!(
                "ALTER TABLE runs ADD COLUMN {name} GENERATED ALWAYS AS ({expression}) VIRTUAL"
            ))?;
        }
    }
    connection.execute_batch(
        "CREATE INDEX IF NOT EXISTS runs_by_submission ON runs (submitted_at, id);
         CREATE INDEX IF NOT EXISTS runs_by_state ON runs (state);",
    )
}

fn sqlite(path: &str, operation: &'static str, source: rusqlite::Error) -> StoreError {
    StoreError::Sqlite { store: path.to_owned(), operation, source }
}

impl Store for SqliteStore {
    /// Loads everything but finished runs (and their events and logs):
    /// those are only counted, and read from the store when asked for.
    fn load(&self) -> Result<Snapshot, StoreError> {
        let connection = self.connection();
        let terminal = terminal_states();
        let read = |source| sqlite(&self.path, "read", source);
        let runs: Vec<RunRecord> = self.query_docs(
            &connection,
            "runs",
            &format!("SELECT id, doc FROM runs WHERE state NOT IN ({terminal}) ORDER BY id"),
            [],
        )?;
        let sandboxes: Vec<SandboxRecord> = self.docs(&connection, "sandboxes")?;
        let credentials: Vec<CredentialRecord> = self.docs(&connection, "credentials")?;
        let threads: Vec<ThreadRecord> = self.docs(&connection, "threads")?;
        let idempotency: Vec<IdempotencyRecord> = self.docs(&connection, "idempotency_keys")?;
        let mut statement = connection
            .prepare(&format!(
                "SELECT e.run_id, e.event_id FROM events e JOIN runs r ON r.id = e.run_id
                 WHERE r.state NOT IN ({terminal}) ORDER BY e.seq"
            ))
            .map_err(read)?;
        let event_ids = statement
            .query_map([], |row| Ok((row.get::<_, String>(0)?, row.get::<_, String>(1)?)))
            .map_err(read)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(read)?;
        // Ledgers, and for runs stored before ledgers were, one made from
        // their chunks.
        let mut statement = connection
            .prepare(&format!(
                "SELECT l.run_id, l.received, l.held, l.over_cap FROM log_ledgers l JOIN runs r ON r.id = l.run_id
                 WHERE r.state NOT IN ({terminal})
                 UNION ALL
                 SELECT c.run_id, MAX(c.start + LENGTH(c.data)), SUM(LENGTH(c.data)), 0 FROM log_chunks c
                 JOIN runs r ON r.id = c.run_id
                 WHERE r.state NOT IN ({terminal}) AND c.run_id NOT IN (SELECT run_id FROM log_ledgers)
                 GROUP BY c.run_id"
            ))
            .map_err(read)?;
        let logs = statement
            .query_map([], |row| {
                let ledger = LogLedger {
                    received: to_u64(row.get(1)?),
                    held: to_u64(row.get(2)?),
                    over_cap: to_u64(row.get(3)?),
                };
                Ok((row.get::<_, String>(0)?, ledger))
            })
            .map_err(read)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(read)?;
        let mut statement = connection
            .prepare(&format!(
                "SELECT state, json_extract(doc, '$.attempts[#-1].path'), COUNT(*) FROM runs
                 WHERE state IN ({terminal}) GROUP BY 1, 2"
            ))
            .map_err(read)?;
        let finished = statement
            .query_map([], |row| Ok((row.get::<_, String>(0)?, row.get::<_, Option<String>>(1)?, to_u64(row.get(2)?))))
            .map_err(read)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(read)?
            .into_iter()
            .filter_map(|(state, path, count)| Some((finished_key(&state, path.as_deref())?, count)))
            .collect();
        Ok(Snapshot { runs, sandboxes, credentials, event_ids, logs, finished, threads, idempotency })
    }

    fn apply(&self, writes: &[Write], fence: Option<&Fence>) -> Result<(), StoreError> {
        if fence.is_some() {
            return Err(StoreError::Unfenceable { store: self.path.clone() });
        }
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
                Write::Log { run_id, offset, data, ledger } => {
                    if !data.is_empty() {
                        transaction
                            .execute(
                                "INSERT INTO log_chunks (run_id, start, data) VALUES (?1, ?2, ?3)",
                                params![run_id, to_i64(*offset), data],
                            )
                            .map_err(write)?;
                    }
                    transaction
                        .execute(
                            "INSERT INTO log_ledgers (run_id, received, held, over_cap) VALUES (?1, ?2, ?3, ?4)
                             ON CONFLICT (run_id) DO UPDATE SET
                                 received = excluded.received, held = excluded.held, over_cap = excluded.over_cap",
                            params![run_id, to_i64(ledger.received), to_i64(ledger.held), to_i64(ledger.over_cap)],
                        )
                        .map_err(write)?;
                }
                Write::Thread { record, expected } => self.write_thread(&transaction, record, *expected)?,
                Write::Idempotency(record) => {
                    transaction
                        .execute(
                            "INSERT INTO idempotency_keys (id, created_at, doc) VALUES (?1, ?2, ?3)
                             ON CONFLICT (id) DO UPDATE SET created_at = excluded.created_at, doc = excluded.doc",
                            params![record.key, record.created_at.0, encode(record)],
                        )
                        .map_err(write)?;
                }
                Write::ForgetIdempotency { through } => {
                    transaction
                        .execute("DELETE FROM idempotency_keys WHERE created_at <= ?1", [through.0])
                        .map_err(write)?;
                }
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
        open_request(&self.sealer, &self.path, run_id, &doc).map(Some)
    }

    fn run(&self, run_id: &str) -> Result<Option<RunRecord>, StoreError> {
        let connection = self.connection();
        let docs = self.query_docs(&connection, "runs", "SELECT id, doc FROM runs WHERE id = ?1", [run_id])?;
        Ok(docs.into_iter().next())
    }

    fn runs(&self, query: &RunQuery) -> Result<Vec<RunRecord>, StoreError> {
        let mut clauses = Vec::new();
        let mut values: Vec<rusqlite::types::Value> = Vec::new();
        if let Some((submitted_at, id)) = &query.after {
            values.push(submitted_at.0.into());
            values.push(id.clone().into());
            let beyond = if query.newest_first { "<" } else { ">" };
            clauses.push(format!("(submitted_at, id) {beyond} (?{}, ?{})", values.len() - 1, values.len()));
        }
        if let Some(state) = query.state {
            values.push(state.as_str().to_owned().into());
            clauses.push(format!("state = ?{}", values.len()));
        }
        if let Some(thread_id) = &query.thread_id {
            values.push(thread_id.clone().into());
            clauses.push(format!("thread_id = ?{}", values.len()));
        }
        let filter = if clauses.is_empty() { String::new() } else { format!("WHERE {}", clauses.join(" AND ")) };
        let order = if query.newest_first { "submitted_at DESC, id DESC" } else { "submitted_at, id" };
        let sql = format!("SELECT id, doc FROM runs {filter} ORDER BY {order} LIMIT {}", query.limit);
        let connection = self.connection();
        self.query_docs(&connection, "runs", &sql, rusqlite::params_from_iter(values))
    }

    fn events(&self, run_id: &str, after: u64, limit: usize) -> Result<Vec<(u64, StoredEvent)>, StoreError> {
        let connection = self.connection();
        let read = |source| sqlite(&self.path, "read", source);
        let mut statement = connection
            .prepare("SELECT seq, event_id, doc FROM events WHERE run_id = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3")
            .map_err(read)?;
        let rows = statement
            .query_map(params![run_id, to_i64(after), to_i64(limit as u64)], |row| {
                Ok((to_u64(row.get(0)?), row.get::<_, String>(1)?, row.get::<_, String>(2)?))
            })
            .map_err(read)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(read)?;
        rows.iter().map(|(seq, id, doc)| Ok((*seq, self.decode("events", id, doc)?))).collect()
    }

    fn log_ledger(&self, run_id: &str) -> Result<Option<LogLedger>, StoreError> {
        let connection = self.connection();
        let read = |source| sqlite(&self.path, "read", source);
        let ledger = connection
            .query_row("SELECT received, held, over_cap FROM log_ledgers WHERE run_id = ?1", [run_id], |row| {
                Ok(LogLedger {
                    received: to_u64(row.get(0)?),
                    held: to_u64(row.get(1)?),
                    over_cap: to_u64(row.get(2)?),
                })
            })
            .optional()
            .map_err(read)?;
        if ledger.is_some() {
            return Ok(ledger);
        }
        // A run stored before ledgers were: its chunks say how far it got.
        connection
            .query_row(
                "SELECT MAX(start + LENGTH(data)), SUM(LENGTH(data)) FROM log_chunks WHERE run_id = ?1",
                [run_id],
                |row| Ok((row.get::<_, Option<i64>>(0)?, row.get::<_, Option<i64>>(1)?)),
            )
            .map(|row| match row {
                (Some(end), Some(held)) => Some(LogLedger { received: to_u64(end), held: to_u64(held), over_cap: 0 }),
                _ => None,
            })
            .map_err(read)
    }

    fn log_pieces(&self, run_id: &str, from: u64, limit: usize) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
        let connection = self.connection();
        let read = |source| sqlite(&self.path, "read", source);
        // The piece holding `from` starts at or before it, every later one
        // after it: both found on the primary key.
        let mut statement = connection
            .prepare(
                "SELECT start, data FROM log_chunks WHERE run_id = ?1 AND start >= COALESCE(
                     (SELECT MAX(start) FROM log_chunks WHERE run_id = ?1 AND start <= ?2), 0)
                 ORDER BY start LIMIT ?3",
            )
            .map_err(read)?;
        let pieces = statement
            .query_map(params![run_id, to_i64(from), to_i64(limit as u64)], |row| {
                Ok((to_u64(row.get(0)?), row.get::<_, Vec<u8>>(1)?))
            })
            .map_err(read)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(read)?;
        Ok(pieces.into_iter().filter(|(start, data)| start + data.len() as u64 > from).collect())
    }

    fn digest(&self, bytes: &[u8]) -> String {
        self.sealer.digest(bytes)
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
            store: self.path.clone(),
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
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;
    use crate::store::contract_tests::{self, Backend as _, contains, full_request, key, request, run};

    #[test]
    fn a_store_made_before_the_run_columns_gets_them() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("old.db");
        {
            let connection = Connection::open(&path).expect("open");
            connection.execute_batch("CREATE TABLE runs (id TEXT PRIMARY KEY, doc TEXT NOT NULL);").expect("old");
            connection
                .execute("INSERT INTO runs (id, doc) VALUES ('exe_1', ?1)", [encode(&run("exe_1"))])
                .expect("row");
        }
        let store = SqliteStore::open(&path, &key()).expect("migrated");
        let page = store.runs(&RunQuery { limit: 10, state: Some(RunState::Queued), ..RunQuery::default() });
        assert_eq!(page.expect("page").len(), 1);
        assert_eq!(store.load().expect("load").runs.len(), 1);
    }

    #[test]
    fn the_store_is_readable_by_its_owner_only() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("data").join("standby.db");
        let store = SqliteStore::open(&path, &key()).expect("open");
        store.apply(&[Write::NewRun(Box::new(run("exe_1")), Box::new(request()))], None).expect("apply");
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
        let backend = contract_tests::Sqlite::new().expect("a SQLite backend");
        let path = &backend.path;
        std::fs::create_dir_all(path.parent().expect("a parent")).expect("its directory");
        let (live, needles) = full_request();
        let mut ended = run("exe_ended");
        ended.state = RunState::Failed;
        {
            let connection = Connection::open(path).expect("open");
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
        assert!(contains(&backend.raw(), needles[0]), "the old version kept it in clear");
        let store = backend.open();
        assert_eq!(store.request("exe_live").expect("read"), Some(live));
        assert_eq!(store.request("exe_ended").expect("read"), None);
        let raw = backend.raw();
        for needle in &needles {
            assert!(!contains(&raw, needle), "`{needle}` is not in clear any more");
        }
    }
}
