//! Group commit through the real engine and a real SQLite store: commands
//! already queued share one transaction, nobody hears back before it is
//! committed, and a failed commit still stops the engine.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::mpsc as std_mpsc;

use standby_protocol::{Run, Workspace, fingerprint};

use super::*;
use crate::credential::RandomMint;
use crate::model::{RunRecord, RunRequest};
use crate::policy::PoolPolicy;
use crate::provider::spool::SpoolProvider;
use crate::rules::{KeyReused, LogLedger, RulesConfig, RunBounds, Snapshot, Submitted, Write};
use crate::seal::SealKey;
use crate::store::{Fence, RunQuery, SqliteStore};

/// A SQLite store that records how many runs each commit created, and
/// optionally holds each commit until the test releases it, or fails it.
struct Recording {
    inner: SqliteStore,
    /// New runs per successful commit, in order.
    commits: Mutex<Vec<usize>>,
    /// Told when a commit begins (before it is held).
    entered: mpsc::UnboundedSender<()>,
    /// When set, each commit waits for one release.
    release: Option<Mutex<std_mpsc::Receiver<()>>>,
    fail: bool,
}

impl Store for Recording {
    fn load(&self) -> Result<Snapshot, StoreError> {
        self.inner.load()
    }

    fn apply(&self, writes: &[Write], fence: Option<&Fence>) -> Result<(), StoreError> {
        let _ = self.entered.send(());
        if let Some(release) = &self.release {
            release.lock().expect("the release lock").recv().expect("the test releases the commit");
        }
        if self.fail {
            return Err(StoreError::Postgres {
                store: "recording".into(),
                operation: "commit",
                detail: "refused by the test".into(),
            });
        }
        self.inner.apply(writes, fence)?;
        let runs = writes.iter().filter(|write| matches!(write, Write::NewRun(..))).count();
        self.commits.lock().expect("the commits lock").push(runs);
        Ok(())
    }

    fn request(&self, run_id: &str) -> Result<Option<RunRequest>, StoreError> {
        self.inner.request(run_id)
    }

    fn run(&self, run_id: &str) -> Result<Option<RunRecord>, StoreError> {
        self.inner.run(run_id)
    }

    fn runs(&self, query: &RunQuery) -> Result<Vec<RunRecord>, StoreError> {
        self.inner.runs(query)
    }

    fn events(
        &self,
        run_id: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<(u64, crate::model::StoredEvent)>, StoreError> {
        self.inner.events(run_id, after, limit)
    }

    fn log_ledger(&self, run_id: &str) -> Result<Option<LogLedger>, StoreError> {
        self.inner.log_ledger(run_id)
    }

    fn log_pieces(&self, run_id: &str, from: u64, limit: usize) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
        self.inner.log_pieces(run_id, from, limit)
    }

    fn digest(&self, bytes: &[u8]) -> String {
        self.inner.digest(bytes)
    }
}

struct Setup {
    store: Arc<Recording>,
    engine: Engine<SpoolProvider>,
    handle: EngineHandle,
    entered: mpsc::UnboundedReceiver<()>,
    release: std_mpsc::Sender<()>,
    _dir: tempfile::TempDir,
}

/// An engine with no pool (a submitted run is only queued: one new run
/// written per submit), not yet running.
fn setup(held: bool, fail: bool) -> Setup {
    let dir = tempfile::tempdir().expect("a temp dir");
    let (entered_tx, entered) = mpsc::unbounded_channel();
    let (release, release_rx) = std_mpsc::channel();
    let store = Arc::new(Recording {
        inner: SqliteStore::open(&dir.path().join("store.db"), &SealKey::random()).expect("the store opens"),
        commits: Mutex::new(Vec::new()),
        entered: entered_tx,
        release: held.then(|| Mutex::new(release_rx)),
        fail,
    });
    let config = RulesConfig {
        heartbeat_interval: Duration::from_secs(1),
        pool_size: 0,
        max_attempts: 1,
        launch_timeout: Duration::from_secs(10),
        run_silence: Duration::from_secs(120),
        linger: Duration::from_secs(1),
        pool_workspace: Workspace::default(),
        pool_fingerprint: fingerprint(&Workspace::default()),
        pool_policy: PoolPolicy::default(),
        bounds: RunBounds::default(),
        snapshots: false,
        trace: false,
    };
    let machine = Rules::new(config, Box::new(RandomMint));
    let provider = Arc::new(SpoolProvider::new(dir.path().join("spool")));
    let engine_config = EngineConfig {
        server_url: "http://127.0.0.1:9".into(),
        heartbeat_interval: Duration::from_secs(1),
        agent_log: "info".into(),
        tick: Duration::from_secs(3600),
        resume_timeout: Duration::from_secs(10),
        clock: Clock::system(),
        leadership: Leadership::sole(),
        tracer: None,
        agent_otlp_endpoint: None,
    };
    let (handle, mailbox) = EngineHandle::mailbox();
    let engine = Engine::new(mailbox, machine, Arc::clone(&store) as Arc<dyn Store>, provider, engine_config);
    Setup { store, engine, handle, entered, release, _dir: dir }
}

type SubmitReply = oneshot::Receiver<Reply>;
type Submission = Result<(Submitted, Option<RunRecord>), KeyReused>;

/// The answer a submit's reply carries.
fn submission(reply: Reply) -> Submission {
    Submission::from_reply(reply).expect("a submit is answered as one")
}

/// Queues `count` submits while the engine is not running yet, so they
/// all wait in its queue together.
async fn queue_submits(handle: &EngineHandle, count: usize) -> Vec<SubmitReply> {
    let mut replies = Vec::with_capacity(count);
    for n in 0..count {
        let (reply, answer) = oneshot::channel();
        let run = Run { command: vec!["echo".into(), n.to_string()], ..Run::default() };
        let request = RunRequest {
            secrets: BTreeMap::new(),
            cloud_env: BTreeMap::new(),
            git_credentials: Vec::new(),
            metadata: serde_json::Value::Null,
            attachments: Vec::new(),
        };
        let input = Input::Submit { run: Box::new(run), request: Box::new(request), thread_id: None, key: None };
        let command = Command::Input { input, reply: Some(reply) };
        handle.tx.send(command).await.expect("the engine's queue has room");
        replies.push(answer);
    }
    replies
}

#[tokio::test]
async fn queued_submits_share_one_commit_and_are_answered_after_it() {
    let Setup { store, engine, handle, mut entered, release, _dir } = setup(true, false);
    let mut replies = queue_submits(&handle, 40).await;
    let (fatal, _fatal_rx) = watch::channel(None);
    let task = tokio::spawn(engine.run(Step::default(), fatal));

    entered.recv().await.expect("the batch's commit begins");
    for answer in &mut replies {
        assert!(
            matches!(answer.try_recv(), Err(oneshot::error::TryRecvError::Empty)),
            "a submit was answered before its commit"
        );
    }
    release.send(()).expect("the commit is released");
    for answer in replies {
        let (submitted, record) = submission(answer.await.expect("answered")).expect("a new run");
        let record = record.expect("the run's record");
        assert_eq!(record.id, submitted.run_id());
        assert_eq!(*store.commits.lock().expect("the commits lock"), [40], "one commit held every submit");
        assert!(store.inner.run(&record.id).expect("the store reads").is_some(), "answered but not committed");
    }
    handle.stop().await;
    task.await.expect("the engine ends");
}

#[tokio::test]
async fn a_batch_holds_at_most_the_bound() {
    let Setup { store, engine, handle, _dir, .. } = setup(false, false);
    let replies = queue_submits(&handle, batch::BOUND + 44).await;
    let (fatal, _fatal_rx) = watch::channel(None);
    let task = tokio::spawn(engine.run(Step::default(), fatal));
    for answer in replies {
        submission(answer.await.expect("answered")).expect("a new run");
    }
    assert_eq!(*store.commits.lock().expect("the commits lock"), [batch::BOUND, 44]);
    handle.stop().await;
    task.await.expect("the engine ends");
}

#[tokio::test]
async fn a_failed_commit_answers_nobody_and_stops_the_engine() {
    let Setup { store, engine, handle, _dir, .. } = setup(false, true);
    let replies = queue_submits(&handle, 10).await;
    let (fatal, mut fatal_rx) = watch::channel(None);
    let task = tokio::spawn(engine.run(Step::default(), fatal));
    for answer in replies {
        assert!(answer.await.is_err(), "a submit of a failed commit was answered");
    }
    task.await.expect("the engine ends by itself");
    let reason = fatal_rx.borrow_and_update().clone().expect("the failure is reported");
    assert!(reason.contains("refused by the test"), "{reason}");
    assert!(store.commits.lock().expect("the commits lock").is_empty());
    let run = handle.ask::<Option<RunRecord>>(Input::Run { run_id: "anything".into() }).await;
    assert!(run.is_err(), "the engine still answers");
}
