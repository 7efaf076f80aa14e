//! The PostgreSQL schema as numbered migrations, and which of them a
//! database needs (pure). A database records what it has had applied in
//! `schema_migrations`; a start applies the missing ones, in order, in one
//! transaction, and refuses a database newer than the binary.
//!
//! A migration, once released, is never edited: a change is a new one.

/// One step of the schema.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Migration {
    pub version: i32,
    pub name: &'static str,
    pub sql: &'static str,
}

/// The table that says which migrations a database has had.
pub(super) const VERSIONS_TABLE: &str = "
CREATE TABLE IF NOT EXISTS schema_migrations (
    version INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
)";

/// Every migration, in order, numbered from 1 without gaps.
///
/// Ids are `COLLATE "C"`: byte order, as SQLite compares, so a page of runs
/// is the same on both stores. Documents are JSON text (`jsonb` would
/// refuse the `\u0000` an error or event may carry); the columns the
/// queries filter on are written beside them from the same record. An event
/// id is the agent's, and may hold a NUL, which `text` cannot: it is kept
/// as its UTF-8 bytes.
pub(super) const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "runs, requests, sandboxes, credentials, events, thread pointers, logs",
        sql: r#"
CREATE TABLE runs (
    id TEXT COLLATE "C" PRIMARY KEY,
    doc TEXT NOT NULL,
    submitted_at BIGINT NOT NULL,
    state TEXT NOT NULL,
    thread_id TEXT COLLATE "C",
    last_path TEXT
);
CREATE INDEX runs_by_submission ON runs (submitted_at, id);
CREATE INDEX runs_by_state ON runs (state);
CREATE INDEX runs_by_thread ON runs (thread_id, submitted_at, id) WHERE thread_id IS NOT NULL;
CREATE TABLE run_requests (run_id TEXT COLLATE "C" PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE sandboxes (id TEXT COLLATE "C" PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE credentials (id TEXT COLLATE "C" PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE events (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id TEXT COLLATE "C" NOT NULL,
    event_id BYTEA NOT NULL,
    doc TEXT NOT NULL,
    UNIQUE (run_id, event_id)
);
CREATE INDEX events_by_run ON events (run_id, seq);
CREATE TABLE threads (id TEXT COLLATE "C" PRIMARY KEY, generation BIGINT NOT NULL, doc TEXT NOT NULL);
CREATE TABLE log_chunks (
    run_id TEXT COLLATE "C" NOT NULL,
    start BIGINT NOT NULL,
    data BYTEA NOT NULL,
    PRIMARY KEY (run_id, start)
);
CREATE TABLE log_ledgers (
    run_id TEXT COLLATE "C" PRIMARY KEY,
    received BIGINT NOT NULL,
    held BIGINT NOT NULL,
    over_cap BIGINT NOT NULL
);
"#,
    },
    Migration {
        version: 2,
        name: "idempotency keys of submissions",
        sql: r#"
CREATE TABLE idempotency_keys (id TEXT COLLATE "C" PRIMARY KEY, created_at BIGINT NOT NULL, doc TEXT NOT NULL);
CREATE INDEX idempotency_keys_by_age ON idempotency_keys (created_at);
"#,
    },
    Migration {
        version: 3,
        name: "the leader's lease and the replicas of a replicated deployment",
        // One lease row, there from the start (expired, epoch 0), so that
        // acquiring and renewing are one UPDATE; `id` only pins it to one row.
        sql: r#"
CREATE TABLE cluster_lease (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    epoch BIGINT NOT NULL,
    holder TEXT NOT NULL,
    holder_url TEXT NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL
);
INSERT INTO cluster_lease (id, epoch, holder, holder_url, expires_at) VALUES (1, 0, '', '', 'epoch');
CREATE TABLE cluster_replicas (id TEXT COLLATE "C" PRIMARY KEY, url TEXT NOT NULL, seen_at TIMESTAMPTZ NOT NULL);
"#,
    },
    Migration {
        version: 4,
        name: "the check of the key run requests are sealed with",
        // One row, written by the first server that opens the store with
        // the check, compared by every later one (`Sealer::key_check`).
        sql: r#"
CREATE TABLE seal_check (id INTEGER PRIMARY KEY CHECK (id = 1), key_check TEXT NOT NULL);
"#,
    },
];

/// The newest version this binary knows.
pub(super) fn known() -> i32 {
    MIGRATIONS.last().map_or(0, |migration| migration.version)
}

/// The migrations a database at `applied` (`0`: a new one) needs, or the
/// database's version when it is newer than this binary.
pub(super) fn pending(applied: i32) -> Result<&'static [Migration], i32> {
    if applied > known() {
        return Err(applied);
    }
    let first = MIGRATIONS.iter().position(|migration| migration.version > applied).unwrap_or(MIGRATIONS.len());
    Ok(&MIGRATIONS[first..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn migrations_are_numbered_from_one_without_gaps() {
        for (index, migration) in MIGRATIONS.iter().enumerate() {
            assert_eq!(usize::try_from(migration.version).ok(), Some(index + 1), "{}", migration.name);
        }
    }

    #[test]
    fn a_database_gets_what_it_lacks_and_a_newer_one_is_refused() {
        assert_eq!(pending(0), Ok(MIGRATIONS));
        assert_eq!(pending(known()), Ok(&[][..]));
        assert_eq!(pending(known() + 1), Err(known() + 1));
    }
}
