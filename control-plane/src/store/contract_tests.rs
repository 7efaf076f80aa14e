//! The store contract: one body per rule, run on every [`Store`]
//! implementation (`contract!` makes a test per backend and rule). A
//! backend opens stores on its own data, as a restarted server does, and
//! shows that data raw, as someone with the file or the database would see it.
//!
//! The PostgreSQL instances need `STANDBY_TEST_POSTGRES` (see
//! `scripts/postgres`): each test gets a schema of its own.

use std::collections::BTreeMap;
use std::path::PathBuf;

use standby_protocol::{Event, EventKind, Run, Secret, Workspace, fingerprint};

use super::{PostgresStore, RunQuery, SqliteStore, Store, StoreError};
use crate::credential::{CredentialKind, TokenHash};
use crate::model::{
    Attempt, AttemptOutcome, CredentialRecord, CredentialState, IdempotencyRecord, Millis, RunPath, RunRecord,
    RunRequest, RunState, SandboxKind, SandboxRecord, StoredAttachment, StoredEvent, ThreadRecord,
};
use crate::rules::{LogLedger, Write};
use crate::seal::{SealKey, Sealer};

/// Where a store's data lives, for the tests.
pub(super) trait Backend {
    /// A store on this backend's data, sealing with `key`.
    fn open_with(&self, key: &SealKey) -> Box<dyn Store>;
    /// Every byte kept of the data: the file (and its companions), or every
    /// row of every table.
    fn raw(&self) -> Vec<u8>;
    /// Runs `sql` on the data directly, as someone with access to it could.
    fn tamper(&self, sql: &str);

    fn open(&self) -> Box<dyn Store> {
        self.open_with(&key())
    }
}

/// A SQLite file in a directory of its own.
pub(super) struct Sqlite {
    _dir: tempfile::TempDir,
    pub(super) path: PathBuf,
}

impl Sqlite {
    pub(super) fn new() -> Option<Self> {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("nested").join("standby.db");
        Some(Self { _dir: dir, path })
    }
}

impl Backend for Sqlite {
    fn open_with(&self, key: &SealKey) -> Box<dyn Store> {
        Box::new(SqliteStore::open(&self.path, key).expect("the SQLite store opens"))
    }

    fn raw(&self) -> Vec<u8> {
        let mut bytes = std::fs::read(&self.path).expect("read the file");
        for suffix in ["-wal", "-shm"] {
            bytes.extend(std::fs::read(format!("{}{suffix}", self.path.display())).unwrap_or_default());
        }
        bytes
    }

    fn tamper(&self, sql: &str) {
        rusqlite::Connection::open(&self.path).expect("open").execute_batch(sql).expect(sql);
    }
}

/// A schema of its own on the test database.
pub(super) struct Postgres {
    pub(super) schema: standby_e2e::postgres::TestSchema,
}

impl Postgres {
    pub(super) fn new(test: &str) -> Option<Self> {
        standby_e2e::postgres::TestSchema::create(test).map(|schema| Self { schema })
    }
}

impl Backend for Postgres {
    /// Another key than the store's is refused at connect (the store keeps
    /// a check of its key): the rules about another key are about the
    /// records, so the check is made the other key's first, as someone
    /// with the database could.
    fn open_with(&self, key: &SealKey) -> Box<dyn Store> {
        let url = Secret::new(self.schema.url());
        let store = match PostgresStore::connect(&url, key) {
            Err(StoreError::SealKeyMismatch { .. }) => {
                self.tamper(&format!("UPDATE seal_check SET key_check = '{}'", Sealer::new(key).key_check()));
                PostgresStore::connect(&url, key)
            }
            opened => opened,
        };
        Box::new(store.expect("the PostgreSQL store opens"))
    }

    fn raw(&self) -> Vec<u8> {
        self.schema.dump().into_bytes()
    }

    fn tamper(&self, sql: &str) {
        self.schema.execute(sql);
    }
}

/// One test per backend for each rule: `sqlite::<rule>`, `postgres::<rule>`.
macro_rules! contract {
    ($($rule:ident),* $(,)?) => {
        mod sqlite {
            $(#[test]
            fn $rule() {
                if let Some(backend) = super::Sqlite::new() {
                    super::$rule(&backend);
                }
            })*
        }
        mod postgres {
            $(#[test]
            fn $rule() {
                if let Some(backend) = super::Postgres::new(concat!("store::contract_tests::postgres::", stringify!($rule))) {
                    super::$rule(&backend);
                }
            })*
        }
    };
}

contract!(
    records_survive_reopening_and_finished_runs_are_only_counted,
    runs_page_in_submission_order_with_filters,
    events_page_in_arrival_order_once_each,
    log_pieces_are_found_from_any_offset,
    a_failing_write_leaves_nothing_half_written,
    a_stale_pointer_write_is_rejected_with_its_whole_step,
    credentials_are_stored_as_hashes,
    requests_are_sealed_at_rest_and_purged_when_the_run_ends,
    a_sealed_request_cannot_be_moved_to_another_run,
    missing_records_read_as_none,
    any_text_round_trips_exactly,
    idempotency_keys_are_kept_with_their_run_and_forgotten_by_age,
    a_request_digest_is_keyed_and_survives_reopening,
    a_sandbox_keeps_the_replica_holding_its_socket,
);

pub(super) fn run(id: &str) -> RunRecord {
    RunRecord::queued(
        id.into(),
        Millis(5),
        Run {
            command: vec!["true".into()],
            cwd: None,
            env: BTreeMap::new(),
            mcp_env: BTreeMap::new(),
            workspace: Some(Workspace::default()),
            strict_mcp: true,
            attachments: None,
        },
        None,
    )
}

fn attempt(path: RunPath) -> Attempt {
    Attempt {
        number: 1,
        sandbox_id: "sbx_1".into(),
        path,
        credential_id: "c1".into(),
        committed_at: Millis(6),
        assignment_sent_at: Some(Millis(7)),
        delivery_confirmed_at: Some(Millis(8)),
        started_at: Some(Millis(9)),
        ended_at: Some(Millis(10)),
        outcome: Some(AttemptOutcome::Finished),
        reason: None,
        install_us: None,
    }
}

/// One key for the whole test binary, so a reopened store opens.
pub(super) fn key() -> SealKey {
    static KEY: std::sync::OnceLock<SealKey> = std::sync::OnceLock::new();
    KEY.get_or_init(SealKey::random).clone()
}

pub(super) fn request() -> RunRequest {
    RunRequest {
        secrets: BTreeMap::from([("TOKEN".into(), Secret::new("s3cret"))]),
        cloud_env: BTreeMap::new(),
        git_credentials: Vec::new(),
        metadata: serde_json::json!({"ticket": 7}),
        attachments: Vec::new(),
    }
}

fn event(run_id: &str, event_id: &str, kind: EventKind) -> StoredEvent {
    StoredEvent { run_id: run_id.into(), attempt: 1, received_at: Millis(9), event: Event::new(event_id, kind) }
}

fn log(run_id: &str, offset: u64, data: &[u8], received: u64, held: u64) -> Write {
    Write::Log { run_id: run_id.into(), offset, data: data.to_vec(), ledger: LogLedger { received, held, over_cap: 0 } }
}

pub(super) fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack.windows(needle.len()).any(|window| window == needle.as_bytes())
}

/// What is given with a run, each value recognisable in raw bytes, and
/// those values.
pub(super) fn full_request() -> (RunRequest, Vec<&'static str>) {
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
        attachments: vec![StoredAttachment {
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

fn records_survive_reopening_and_finished_runs_are_only_counted(backend: &dyn Backend) {
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
        let store = backend.open();
        let mut updated = run("exe_1");
        updated.state = RunState::Running;
        let mut finished = run("exe_2");
        finished.state = RunState::Exited;
        finished.log_lost = Some(7);
        let mut warm = run("exe_3");
        warm.state = RunState::Exited;
        warm.attempts.push(attempt(RunPath::Warm));
        let started = event("exe_1", "e1", EventKind::Started);
        store
            .apply(
                &[
                    Write::NewRun(Box::new(run("exe_1")), Box::new(request())),
                    Write::Credential(Box::new(credential.clone())),
                    Write::Run(Box::new(updated)),
                    Write::Event(Box::new(started.clone())),
                    Write::Event(Box::new(started)),
                    log("exe_1", 0, b"hel", 3, 3),
                    log("exe_1", 3, b"lo", 5, 5),
                    Write::NewRun(Box::new(finished), Box::new(request())),
                    Write::NewRun(Box::new(run("exe_3")), Box::new(request())),
                    Write::Event(Box::new(event("exe_3", "e1", EventKind::Exited { code: 0 }))),
                    log("exe_3", 0, b"done", 4, 4),
                ],
                None,
            )
            .expect("apply");
        // Finished in a later step, as a run does.
        store.apply(&[Write::Run(Box::new(warm))], None).expect("apply");
    }
    let store = backend.open();
    let snapshot = store.load().expect("load");
    assert_eq!(snapshot.runs.len(), 1, "the finished runs are not loaded");
    assert_eq!(snapshot.runs[0].state, RunState::Running);
    let mut finished = snapshot.finished.clone();
    finished.sort();
    assert_eq!(finished, [((RunState::Exited, None), 1), ((RunState::Exited, Some(RunPath::Warm)), 1)], "counted");
    assert_eq!(
        store.run("exe_2").expect("run").map(|run| (run.state, run.log_lost)),
        Some((RunState::Exited, Some(7))),
        "with what its agent said of its log"
    );
    assert_eq!(snapshot.credentials, [credential]);
    assert_eq!(snapshot.event_ids, [("exe_1".to_owned(), "e1".to_owned())], "once, and only the live run's");
    assert_eq!(snapshot.logs, [("exe_1".to_owned(), LogLedger { received: 5, held: 5, over_cap: 0 })]);
    assert_eq!(store.log_pieces("exe_1", 0, 10).expect("log"), [(0, b"hel".to_vec()), (3, b"lo".to_vec())]);
    assert_eq!(store.request("exe_1").expect("request"), Some(request()));
    assert_eq!(store.request("exe_2").expect("request"), None, "a run terminal at birth keeps no request");
    assert_eq!(store.request("exe_3").expect("request"), None, "purged when it ended");
    assert_eq!(store.log_pieces("exe_3", 0, 10).expect("log"), [(0, b"done".to_vec())], "read when asked for");
    assert_eq!(store.log_ledger("exe_3").expect("ledger"), Some(LogLedger { received: 4, held: 4, over_cap: 0 }));
    assert_eq!(store.events("exe_3", 0, 10).expect("events").len(), 1);
}

fn runs_page_in_submission_order_with_filters(backend: &dyn Backend) {
    let store = backend.open();
    let writes: Vec<Write> = (0..25)
        .map(|n| {
            let mut record = run(&format!("exe_{n:02}"));
            record.submitted_at = Millis(1000 - n % 5);
            record.state = if n % 2 == 0 { RunState::Exited } else { RunState::Queued };
            record.thread_id = (n % 3 == 0).then(|| "t".to_owned());
            Write::NewRun(Box::new(record), Box::new(request()))
        })
        .collect();
    store.apply(&writes, None).expect("apply");
    let mut seen = Vec::new();
    let mut query = RunQuery { limit: 7, ..RunQuery::default() };
    loop {
        let page = store.runs(&query).expect("page");
        seen.extend(page.iter().map(|run| (run.submitted_at, run.id.clone())));
        let Some(last) = page.last().filter(|_| page.len() == query.limit) else { break };
        query.after = Some((last.submitted_at, last.id.clone()));
    }
    let mut sorted = seen.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(seen, sorted, "every run once, in order");
    assert_eq!(seen.len(), 25);
    let exited = store.runs(&RunQuery { limit: 100, state: Some(RunState::Exited), ..RunQuery::default() });
    assert_eq!(exited.expect("page").len(), 13);
    let thread = RunQuery { limit: 100, thread_id: Some("t".into()), ..RunQuery::default() };
    assert_eq!(store.runs(&thread).expect("page").len(), 9);
    let both = RunQuery { limit: 100, thread_id: Some("t".into()), state: Some(RunState::Queued), ..thread };
    assert_eq!(store.runs(&both).expect("page").len(), 4, "exe_03, 09, 15, 21");
    let newest = RunQuery { limit: 3, newest_first: true, ..RunQuery::default() };
    let page: Vec<(Millis, String)> =
        store.runs(&newest).expect("page").iter().map(|run| (run.submitted_at, run.id.clone())).collect();
    assert_eq!(page, seen.iter().rev().take(3).cloned().collect::<Vec<_>>(), "the newest three, newest first");
    let older = RunQuery { after: page.last().cloned(), ..newest };
    let next: Vec<String> = store.runs(&older).expect("page").into_iter().map(|run| run.id).collect();
    let expected: Vec<String> = seen.iter().rev().skip(3).take(3).map(|(_, id)| id.clone()).collect();
    assert_eq!(next, expected, "`after` is older than, newest first");
}

fn events_page_in_arrival_order_once_each(backend: &dyn Backend) {
    let store = backend.open();
    store.apply(&[Write::NewRun(Box::new(run("exe_1")), Box::new(request()))], None).expect("apply");
    for (n, id) in ["b", "a", "c", "a"].into_iter().enumerate() {
        let kind = if n == 0 { EventKind::Started } else { EventKind::Exited { code: 1 } };
        store
            .apply(
                &[
                    Write::Event(Box::new(event("exe_1", id, kind))),
                    Write::Event(Box::new(event("exe_2", id, EventKind::Started))),
                ],
                None,
            )
            .expect("apply");
    }
    let ids = |page: &[(u64, StoredEvent)]| page.iter().map(|(_, e)| e.event.event_id.clone()).collect::<Vec<_>>();
    let all = store.events("exe_1", 0, 10).expect("events");
    assert_eq!(ids(&all), ["b", "a", "c"], "arrival order, a repeated id kept once");
    let first = store.events("exe_1", 0, 2).expect("events");
    assert_eq!(ids(&first), ["b", "a"]);
    let rest = store.events("exe_1", first[1].0, 2).expect("events");
    assert_eq!(ids(&rest), ["c"], "the next page starts after the last number seen");
    assert!(store.events("exe_1", all[2].0, 10).expect("events").is_empty());
    assert_eq!(store.events("exe_2", 0, 10).expect("events").len(), 3, "another run's ids are its own");
}

fn log_pieces_are_found_from_any_offset(backend: &dyn Backend) {
    let store = backend.open();
    // A gap between 5 and 8: the agent dropped those bytes.
    store
        .apply(&[log("exe_1", 0, b"hel", 3, 3), log("exe_1", 3, b"lo", 5, 5), log("exe_1", 8, b"world", 13, 10)], None)
        .expect("apply");
    assert_eq!(store.log_pieces("exe_1", 4, 10).expect("log"), [(3, b"lo".to_vec()), (8, b"world".to_vec())]);
    assert_eq!(store.log_pieces("exe_1", 6, 10).expect("log"), [(8, b"world".to_vec())], "from inside the gap");
    assert_eq!(store.log_pieces("exe_1", 0, 1).expect("log"), [(0, b"hel".to_vec())], "limited");
    assert_eq!(store.log_pieces("exe_1", 13, 10).expect("log"), []);
    // Bytes over the cap: counted in the ledger, nothing stored.
    store
        .apply(
            &[Write::Log {
                run_id: "exe_1".into(),
                offset: 13,
                data: Vec::new(),
                ledger: LogLedger { received: 20, held: 10, over_cap: 7 },
            }],
            None,
        )
        .expect("apply");
    assert_eq!(store.log_ledger("exe_1").expect("ledger"), Some(LogLedger { received: 20, held: 10, over_cap: 7 }));
    assert_eq!(store.log_pieces("exe_1", 13, 10).expect("log"), []);
}

fn a_failing_write_leaves_nothing_half_written(backend: &dyn Backend) {
    let store = backend.open();
    store.apply(&[Write::NewRun(Box::new(run("exe_1")), Box::new(request()))], None).expect("apply");
    let mut changed = run("exe_1");
    changed.state = RunState::Failed;
    // The second NewRun of the same id violates the primary key.
    let error = store
        .apply(&[Write::Run(Box::new(changed)), Write::NewRun(Box::new(run("exe_1")), Box::new(request()))], None)
        .expect_err("a duplicate run is refused");
    assert!(error.to_string().contains("write"), "{error}");
    assert_eq!(store.load().expect("load").runs[0].state, RunState::Queued, "the first write was rolled back");
    assert_eq!(store.request("exe_1").expect("request"), Some(request()), "not purged either");
    // The store is usable after a failed step.
    store.apply(&[Write::NewRun(Box::new(run("exe_2")), Box::new(request()))], None).expect("apply after a failure");
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

/// Two servers on one store: the one that read an older generation of the
/// pointer cannot overwrite the newer one, and nothing else of its step is
/// written either.
fn a_stale_pointer_write_is_rejected_with_its_whole_step(backend: &dyn Backend) {
    let first = backend.open();
    let second = backend.open();
    first.apply(&[Write::Thread { record: Box::new(pointer(1, "sbx_a")), expected: 0 }], None).expect("created");
    // Both read generation 1; the first writer wins.
    first.apply(&[Write::Thread { record: Box::new(pointer(2, "sbx_b")), expected: 1 }], None).expect("moved on");
    let error = second
        .apply(
            &[
                Write::NewRun(Box::new(run("exe_late")), Box::new(request())),
                Write::Thread { record: Box::new(pointer(2, "sbx_stale")), expected: 1 },
            ],
            None,
        )
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
        .apply(&[Write::Thread { record: Box::new(pointer(1, "sbx_c")), expected: 0 }], None)
        .expect_err("already created");
    assert!(matches!(error, StoreError::StalePointer { expected: 0, found: 2, .. }), "{error}");
}

fn credentials_are_stored_as_hashes(backend: &dyn Backend) {
    let store = backend.open();
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
    store.apply(&[Write::Credential(Box::new(credential.clone()))], None).expect("apply");
    drop(store);
    let raw = backend.raw();
    assert!(contains(&raw, "sbx_1"), "the record is there");
    assert!(!contains(&raw, "averyrecognisablesecret"), "the token is not");
    assert_eq!(backend.open().load().expect("load").credentials, [credential], "and it still checks");
}

fn requests_are_sealed_at_rest_and_purged_when_the_run_ends(backend: &dyn Backend) {
    let store = backend.open();
    let (request, needles) = full_request();
    store.apply(&[Write::NewRun(Box::new(run("exe_1")), Box::new(request.clone()))], None).expect("apply");
    assert_eq!(store.request("exe_1").expect("read"), Some(request), "served while the run lives");
    let raw = backend.raw();
    for needle in &needles {
        assert!(!contains(&raw, needle), "`{needle}` is sealed, never in clear");
    }
    assert!(contains(&raw, "sealed1:"), "the request is stored, sealed");

    let mut ended = run("exe_1");
    ended.state = RunState::Exited;
    store.apply(&[Write::Run(Box::new(ended))], None).expect("apply");
    assert_eq!(store.request("exe_1").expect("read"), None, "purged with the terminal state");
    drop(store);
    let store = backend.open();
    assert_eq!(store.run("exe_1").expect("read").map(|run| run.state), Some(RunState::Exited));
    assert_eq!(store.request("exe_1").expect("read"), None);
    let raw = backend.raw();
    assert!(!contains(&raw, "sealed1:"), "not even sealed");
    for needle in &needles {
        assert!(!contains(&raw, needle), "`{needle}` is nowhere after the purge");
    }
}

/// A sealed request copied onto another run's row does not open: the run
/// id is its associated data.
fn a_sealed_request_cannot_be_moved_to_another_run(backend: &dyn Backend) {
    let store = backend.open();
    let (request, _) = full_request();
    store
        .apply(
            &[
                Write::NewRun(Box::new(run("exe_1")), Box::new(request)),
                Write::NewRun(Box::new(run("exe_2")), Box::new(self::request())),
            ],
            None,
        )
        .expect("apply");
    backend.tamper(
        "UPDATE run_requests SET doc = (SELECT doc FROM run_requests WHERE run_id = 'exe_1') WHERE run_id = 'exe_2'",
    );
    let error = store.request("exe_2").expect_err("does not open as another run's");
    assert!(matches!(&error, StoreError::Corrupt { id, .. } if id == "exe_2"), "{error}");
    assert!(store.request("exe_1").is_ok());
    let other_key = backend.open_with(&SealKey::random());
    assert!(other_key.request("exe_1").is_err(), "another key does not open it either");
}

fn missing_records_read_as_none(backend: &dyn Backend) {
    let store = backend.open();
    assert_eq!(store.run("exe_none").expect("run"), None);
    assert_eq!(store.request("exe_none").expect("request"), None);
    assert_eq!(store.log_ledger("exe_none").expect("ledger"), None, "no ledger before the first chunk");
    assert!(store.log_pieces("exe_none", 0, 10).expect("log").is_empty());
    assert!(store.events("exe_none", 0, 10).expect("events").is_empty());
    assert!(store.runs(&RunQuery { limit: 10, ..RunQuery::default() }).expect("runs").is_empty());
    let snapshot = store.load().expect("load");
    assert!(snapshot.runs.is_empty() && snapshot.threads.is_empty() && snapshot.finished.is_empty());
    assert!(store.apply(&[], None).is_ok(), "an empty step writes nothing");
    // Ids from a URL may hold anything: none is found, nothing fails.
    assert_eq!(store.run("exe\0x").expect("run"), None);
    assert_eq!(store.request("exe\0x").expect("request"), None);
    assert!(store.events("exe\0x", 0, 10).expect("events").is_empty());
    assert_eq!(store.log_ledger("exe\0x").expect("ledger"), None);
    assert!(store.log_pieces("exe\0x", 0, 10).expect("log").is_empty());
    let odd = RunQuery { limit: 10, thread_id: Some("t\0".into()), ..RunQuery::default() };
    assert!(store.runs(&odd).expect("runs").is_empty());
}

/// A run's command, error and events hold whatever the user and the agent
/// sent: NUL characters, quotes, backslashes, any script.
fn any_text_round_trips_exactly(backend: &dyn Backend) {
    let odd = "nul\u{0} quote\" backslash\\ tab\t é 日本 \u{1F600}";
    let mut record = run("exe_odd");
    record.run.command = vec!["echo".into(), odd.into()];
    record.error = Some(odd.into());
    let failed = EventKind::InstallFailed { requeueable: false, stage: "check".into(), message: odd.into() };
    let stored = event("exe_odd", odd, failed);
    backend
        .open()
        .apply(
            &[Write::NewRun(Box::new(record.clone()), Box::new(request())), Write::Event(Box::new(stored.clone()))],
            None,
        )
        .expect("apply");
    let store = backend.open();
    assert_eq!(store.run("exe_odd").expect("run"), Some(record));
    assert_eq!(
        store.events("exe_odd", 0, 10).expect("events").into_iter().map(|(_, e)| e).collect::<Vec<_>>(),
        [stored]
    );
    assert_eq!(store.load().expect("load").event_ids, [("exe_odd".to_owned(), odd.to_owned())]);
}

fn kept_key(key: &str, run_id: &str, created_at: i64) -> Write {
    Write::Idempotency(Box::new(IdempotencyRecord {
        key: key.into(),
        request_hash: format!("hash-of-{run_id}"),
        run_id: run_id.into(),
        created_at: Millis(created_at),
    }))
}

fn idempotency_keys_are_kept_with_their_run_and_forgotten_by_age(backend: &dyn Backend) {
    let store = backend.open();
    store
        .apply(&[Write::NewRun(Box::new(run("exe_1")), Box::new(request())), kept_key("k/1 ü", "exe_1", 10)], None)
        .expect("apply");
    // Committed with the run: a step whose run is refused keeps no key.
    store
        .apply(&[Write::NewRun(Box::new(run("exe_1")), Box::new(request())), kept_key("k2", "exe_1", 20)], None)
        .expect_err("a duplicate run is refused");
    store
        .apply(&[Write::NewRun(Box::new(run("exe_2")), Box::new(request())), kept_key("k3", "exe_2", 30)], None)
        .expect("apply");
    let loaded = backend.open().load().expect("load").idempotency;
    let keys: Vec<(&str, &str, i64)> =
        loaded.iter().map(|kept| (kept.key.as_str(), kept.run_id.as_str(), kept.created_at.0)).collect();
    assert_eq!(keys, [("k/1 ü", "exe_1", 10), ("k3", "exe_2", 30)]);
    assert_eq!(loaded[0].request_hash, "hash-of-exe_1");
    // A key past its window that was not forgotten yet is replaced.
    store
        .apply(&[Write::NewRun(Box::new(run("exe_3")), Box::new(request())), kept_key("k/1 ü", "exe_3", 40)], None)
        .expect("apply");
    store.apply(&[Write::ForgetIdempotency { through: Millis(30) }], None).expect("forget");
    let left: Vec<String> = store.load().expect("load").idempotency.into_iter().map(|kept| kept.run_id).collect();
    assert_eq!(left, ["exe_3"]);
}

fn a_request_digest_is_keyed_and_survives_reopening(backend: &dyn Backend) {
    let body = br#"{"command":["true"],"secrets":{"TOKEN":"hunter2"}}"#;
    let digest = backend.open().digest(body);
    assert_eq!(backend.open().digest(body), digest, "a retry after a restart is recognised");
    assert_ne!(backend.open_with(&SealKey::random()).digest(body), digest, "keyed by the seal key");
    let plain = crate::credential::hex(&<sha2::Sha256 as sha2::Digest>::digest(body));
    assert_ne!(digest, plain, "not a plain hash a reader of the database could test guesses against");
}

/// Which replica holds an agent's socket (issue 27) is part of the
/// sandbox's record: a new leader reads it back with the rest.
fn a_sandbox_keeps_the_replica_holding_its_socket(backend: &dyn Backend) {
    let held_by = Some(crate::model::Holder { replica: "r2".into(), epoch: 7 });
    let fresh = (None, fingerprint(&Workspace::default()));
    let record = SandboxRecord {
        connections: 1,
        held_by: held_by.clone(),
        ..SandboxRecord::standby("sbx_held".into(), SandboxKind::Warm, Millis(1), "cred_1".into(), fresh)
    };
    backend.open().apply(&[Write::Sandbox(Box::new(record))], None).expect("the write commits");
    let loaded = backend.open().load().expect("the store loads");
    let sandbox = loaded.sandboxes.iter().find(|sandbox| sandbox.id == "sbx_held").expect("the sandbox");
    assert_eq!(sandbox.held_by, held_by);
}
