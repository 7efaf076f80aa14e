use std::collections::BTreeMap;

use standby_protocol::{Cause, Repo, Stage, Workspace};

use super::*;
use crate::credential::CountingMint;

const SECOND: i64 = 1000;

fn config(pool_size: usize) -> DispatchConfig {
    DispatchConfig {
        heartbeat_interval: Duration::from_secs(1),
        pool_size,
        max_attempts: 3,
        launch_timeout: Duration::from_secs(10),
        linger: Duration::from_secs(5),
        pool_workspace: Workspace::default(),
        pool_fingerprint: fingerprint(&Workspace::default()),
        pool_policy: PoolPolicy::default(),
        bounds: RunBounds::default(),
    }
}

fn run(command: &str) -> Run {
    Run {
        command: vec![command.to_owned()],
        cwd: None,
        env: BTreeMap::new(),
        mcp_env: BTreeMap::new(),
        workspace: None,
        strict_mcp: false,
        attachments: None,
    }
}

fn request() -> RunRequest {
    RunRequest {
        secrets: BTreeMap::new(),
        cloud_env: BTreeMap::new(),
        git_credentials: Vec::new(),
        metadata: serde_json::Value::Null,
        attachments: Vec::new(),
    }
}

/// A launched sandbox as a test sees it: its id and standby token.
#[derive(Debug, Clone)]
struct Launched {
    sandbox_id: String,
    token: Secret,
}

fn launches(step: &Step) -> Vec<Launched> {
    step.effects
        .iter()
        .filter_map(|effect| match effect {
            Effect::Launch { sandbox_id, token, .. } => {
                Some(Launched { sandbox_id: sandbox_id.clone(), token: token.clone() })
            }
            _ => None,
        })
        .collect()
}

fn assignments(step: &Step) -> Vec<(ConnId, Assignment)> {
    step.effects
        .iter()
        .filter_map(|effect| match effect {
            Effect::Send { conn, message: ServerMessage::Assignment(assignment) } => Some((*conn, assignment.clone())),
            _ => None,
        })
        .collect()
}

fn sends(step: &Step, conn: ConnId) -> Vec<ServerMessage> {
    step.effects
        .iter()
        .filter_map(|effect| match effect {
            Effect::Send { conn: to, message } if *to == conn => Some(message.clone()),
            _ => None,
        })
        .collect()
}

fn closes(step: &Step) -> Vec<ConnId> {
    step.effects.iter().filter_map(|e| if let Effect::Close { conn } = e { Some(*conn) } else { None }).collect()
}

fn retires(step: &Step) -> Vec<String> {
    step.effects
        .iter()
        .filter_map(|e| if let Effect::Retire { sandbox_id, .. } = e { Some(sandbox_id.clone()) } else { None })
        .collect()
}

/// The machine plus a clock and a record of every write, from which a
/// restart's snapshot is built.
struct World {
    machine: Dispatch,
    now: Millis,
    next_conn: ConnId,
    writes: Vec<Write>,
}

impl World {
    fn new(pool_size: usize) -> Self {
        Self::with(config(pool_size))
    }

    fn with(config: DispatchConfig) -> Self {
        Self {
            machine: Dispatch::new(config, Box::new(CountingMint::default())),
            now: Millis(1_000_000),
            next_conn: 1,
            writes: Vec::new(),
        }
    }

    fn keep(&mut self, step: Step) -> Step {
        self.writes.extend(step.writes.iter().cloned());
        step
    }

    fn advance(&mut self, millis: i64) {
        self.now = Millis(self.now.0 + millis);
    }

    fn tick(&mut self) -> Step {
        let step = self.machine.tick(self.now);
        self.keep(step)
    }

    /// Connects with `token`: the admission, the connection id and the step.
    /// Connects with `token`, as an agent does once it has fetched its spec
    /// (with a standby credential).
    fn connect(&mut self, token: &Secret) -> (Admission, ConnId, Step) {
        if let Ok(Admission::Standby { sandbox_id, .. }) = self.machine.authenticate(token.expose()) {
            let step = self.machine.spec_served(&sandbox_id);
            self.keep(step);
        }
        self.connect_only(token)
    }

    /// Connects with `token`, nothing else.
    fn connect_only(&mut self, token: &Secret) -> (Admission, ConnId, Step) {
        let conn = self.next_conn;
        self.next_conn += 1;
        let (admission, claimed) = self.machine.claim_socket(self.now, conn, token.expose()).expect("admitted");
        self.keep(claimed);
        let step = self.machine.connected(self.now, conn, admission.credential_id(), token);
        (admission, conn, self.keep(step))
    }

    fn heartbeat(&mut self, conn: ConnId, state: AgentState) -> Step {
        let step = self.machine.heartbeat(self.now, conn, state);
        self.keep(step)
    }

    /// Fills the pool and brings every standby to `ready`: their launches
    /// and connections.
    fn ready_pool(&mut self) -> Vec<(Launched, ConnId)> {
        let step = self.tick();
        let mut pool = Vec::new();
        for launched in launches(&step) {
            let (_, conn, _) = self.connect(&launched.token);
            self.heartbeat(conn, AgentState::Ready);
            pool.push((launched, conn));
        }
        pool
    }

    fn submit(&mut self, run: Run) -> (String, Step) {
        let (step, id) = self.machine.submit(self.now, run, request());
        (id, self.keep(step))
    }

    fn event(&mut self, run_id: &str, id: &str, kind: EventKind) -> Step {
        let attempt = self.run(run_id).attempts.len() as u32;
        let step = self.machine.event(self.now, run_id, attempt, Event { event_id: id.to_owned(), kind });
        self.keep(step)
    }

    fn run(&self, run_id: &str) -> RunRecord {
        self.machine.run(run_id).expect("the run exists").clone()
    }

    fn sandbox(&self, sandbox_id: &str) -> SandboxRecord {
        self.machine.sandbox(sandbox_id).expect("the sandbox exists").clone()
    }

    /// What the store would hold: the last write of each record.
    fn snapshot(&self) -> Snapshot {
        let mut runs = BTreeMap::new();
        let mut sandboxes = BTreeMap::new();
        let mut credentials = BTreeMap::new();
        let mut event_ids = Vec::new();
        let mut logs: BTreeMap<String, LogLedger> = BTreeMap::new();
        let mut threads = BTreeMap::new();
        for write in &self.writes {
            match write {
                Write::NewRun(run, _) | Write::Run(run) => {
                    runs.insert(run.id.clone(), (**run).clone());
                }
                Write::Sandbox(sandbox) => {
                    sandboxes.insert(sandbox.id.clone(), (**sandbox).clone());
                }
                Write::Credential(credential) => {
                    credentials.insert(credential.id.clone(), (**credential).clone());
                }
                Write::Event(event) => event_ids.push((event.run_id.clone(), event.event.event_id.clone())),
                Write::Log { run_id, ledger, .. } => {
                    logs.insert(run_id.clone(), *ledger);
                }
                Write::Thread { record, expected } => {
                    assert_eq!(
                        threads.get(&record.id).map_or(0, |t: &ThreadRecord| t.generation),
                        *expected,
                        "every pointer write expects the generation before it"
                    );
                    threads.insert(record.id.clone(), (**record).clone());
                }
            }
        }
        // As the store loads it: finished runs only counted.
        let mut finished: BTreeMap<(RunState, Option<RunPath>), u64> = BTreeMap::new();
        for run in runs.values().filter(|run| run.state.is_terminal()) {
            *finished.entry((run.state, run.path())).or_default() += 1;
        }
        runs.retain(|_, run| !run.state.is_terminal());
        event_ids.retain(|(run_id, _)| runs.contains_key(run_id));
        logs.retain(|run_id, _| runs.contains_key(run_id));
        Snapshot {
            runs: runs.into_values().collect(),
            sandboxes: sandboxes.into_values().collect(),
            credentials: credentials.into_values().collect(),
            event_ids,
            logs: logs.into_iter().collect(),
            finished: finished.into_iter().collect(),
            threads: threads.into_values().collect(),
        }
    }
}

/// Index of the first write matching `predicate`.
fn position(step: &Step, predicate: impl Fn(&Write) -> bool) -> usize {
    step.writes.iter().position(predicate).expect("a matching write")
}

fn revokes(credential_id: &str) -> impl Fn(&Write) -> bool + '_ {
    move |write| matches!(write, Write::Credential(c) if c.id == credential_id && c.state == CredentialState::Revoked)
}

// ---- the pool ---------------------------------------------------------------

#[test]
fn the_pool_is_filled_with_standbys_that_have_their_own_credentials() {
    let mut world = World::new(2);
    let step = world.tick();
    let launched = launches(&step);
    assert_eq!(launched.len(), 2);
    assert!(step.effects.iter().all(|e| matches!(e, Effect::Launch { create: true, .. })));
    for launched in &launched {
        assert_eq!(world.sandbox(&launched.sandbox_id).kind, SandboxKind::Warm);
        let admission = world.machine.authenticate(launched.token.expose()).expect("admitted");
        assert!(matches!(admission, Admission::Standby { ref sandbox_id, .. } if *sandbox_id == launched.sandbox_id));
    }
    // Credentials are written as hashes only.
    for write in &step.writes {
        let text = format!("{write:?}");
        for launched in &launched {
            assert!(!text.contains(launched.token.expose()), "a write holds a token: {text}");
        }
    }
    assert!(world.tick().is_empty(), "a full pool launches nothing more");
}

#[test]
fn an_exited_standby_is_replaced_and_repeated_failures_back_off() {
    let mut world = World::new(1);
    let first = launches(&world.tick()).remove(0);
    // Preparation failed: exit 15 without ever being ready.
    let step = world.machine.sandbox_exited(world.now, &first.sandbox_id, Some(15));
    assert_eq!(world.sandbox(&first.sandbox_id).state, SandboxState::Retired);
    assert!(launches(&step).is_empty(), "backoff: no replacement at once after a failure");
    assert_eq!(world.machine.authenticate(first.token.expose()), Err(Refusal::Gone));
    world.advance(SECOND + 1);
    let second = launches(&world.tick()).remove(0);
    let (_, conn, _) = world.connect(&second.token);
    world.heartbeat(conn, AgentState::Ready);
    // A standby that was ready and then exits is replaced at once.
    let step = world.machine.sandbox_exited(world.now, &second.sandbox_id, Some(0));
    assert_eq!(launches(&step).len(), 1);
}

#[test]
fn a_silent_standby_is_retired_and_replaced() {
    let mut world = World::new(1);
    let (standby, conn) = world.ready_pool().remove(0);
    world.advance(3 * SECOND);
    assert!(world.tick().is_empty(), "three intervals of silence are allowed");
    world.advance(1);
    let step = world.tick();
    assert_eq!(retires(&step), std::slice::from_ref(&standby.sandbox_id));
    assert!(matches!(sends(&step, conn).as_slice(), [ServerMessage::Retired(_)]));
    assert_eq!(launches(&step).len(), 1);
    assert_eq!(world.machine.authenticate(standby.token.expose()), Err(Refusal::Gone));
}

#[test]
fn a_standby_that_never_connects_is_retired_after_the_launch_timeout() {
    let mut world = World::new(1);
    let standby = launches(&world.tick()).remove(0);
    world.advance(10 * SECOND);
    assert!(world.tick().is_empty());
    world.advance(1);
    assert_eq!(retires(&world.tick()), [standby.sandbox_id]);
}

// ---- candidates and commit before tell -----------------------------------------

#[test]
fn commit_before_tell_binds_the_run_in_the_same_step_that_sends_the_assignment() {
    let mut world = World::new(1);
    let (standby, conn) = world.ready_pool().remove(0);
    let (run_id, step) = world.submit(run("true"));
    let bound = position(
        &step,
        |w| matches!(w, Write::Sandbox(s) if s.id == standby.sandbox_id && s.state == SandboxState::Assigned && s.run_id.as_deref() == Some(run_id.as_str())),
    );
    let committed = position(&step, |w| matches!(w, Write::Run(r) if r.state == RunState::Committed));
    assert!(bound < step.writes.len() && committed < step.writes.len());
    let sent = assignments(&step);
    assert_eq!(sent.len(), 1);
    let (to, assignment) = &sent[0];
    assert_eq!(*to, conn);
    assert_eq!(assignment.execution_id, run_id);
    let record = world.run(&run_id);
    assert_eq!(record.state, RunState::Committed);
    assert_eq!(record.path(), Some(RunPath::Warm));
    // The credential in the frame is the attempt's run credential.
    match world.machine.authenticate(assignment.run_credential.expose()) {
        Ok(Admission::Run { run_id: of, attempt: 1, sandbox_id, .. }) => {
            assert_eq!(of, run_id);
            assert_eq!(sandbox_id, standby.sandbox_id);
        }
        other => panic!("the run credential is not admitted: {other:?}"),
    }
}

#[test]
fn a_candidate_heartbeated_ready_within_three_intervals() {
    let mut world = World::new(1);
    let (standby, conn) = world.ready_pool().remove(0);
    world.advance(3 * SECOND);
    let (warm, _) = world.submit(run("a"));
    assert_eq!(world.run(&warm).current().map(|a| a.sandbox_id.clone()), Some(standby.sandbox_id.clone()));

    let mut world = World::new(1);
    let (_, conn2) = world.ready_pool().remove(0);
    assert_eq!(conn, conn2);
    world.advance(3 * SECOND + 1);
    let (cold, step) = world.submit(run("b"));
    assert_eq!(world.run(&cold).path(), Some(RunPath::Cold));
    assert_eq!(launches(&step).len(), 1);
}

#[test]
fn a_preparing_or_disconnected_standby_is_not_a_candidate() {
    let mut world = World::new(1);
    let standby = launches(&world.tick()).remove(0);
    let (_, conn, _) = world.connect(&standby.token);
    world.heartbeat(conn, AgentState::Preparing);
    let (first, _) = world.submit(run("a"));
    assert_eq!(world.run(&first).path(), Some(RunPath::Cold));
    world.heartbeat(conn, AgentState::Ready);
    world.machine.disconnected(conn);
    let (second, _) = world.submit(run("b"));
    assert_eq!(world.run(&second).path(), Some(RunPath::Cold));
}

#[test]
fn a_run_whose_workspace_differs_is_tried_warm_then_cold_on_that_workspace() {
    let mut world = World::new(1);
    world.ready_pool();
    let mut other = run("x");
    other.workspace = Some(Workspace {
        repos: vec![Repo { url: "file:///elsewhere".into(), path: "app".into(), git_ref: None, expected_sha: None }],
        setup: Vec::new(),
    });
    let (run_id, _) = world.submit(other.clone());
    assert_eq!(world.run(&run_id).path(), Some(RunPath::Warm), "the agent, not the server, compares workspaces");
    let mismatch = EventKind::install_failed(Stage::SamePreparation, Cause::FingerprintMismatch, "fingerprint");
    let step = world.event(&run_id, "f", mismatch);
    let record = world.run(&run_id);
    let cold =
        launches(&step).into_iter().find(|l| l.sandbox_id == record.attempts[1].sandbox_id).expect("a cold launch");
    let sandbox = world.sandbox(&cold.sandbox_id);
    assert_eq!(sandbox.workspace, other.workspace, "the cold sandbox prepares the run's workspace");
    assert_eq!(sandbox.fingerprint, fingerprint(other.workspace.as_ref().expect("a workspace")));
    assert_eq!(sandbox.kind, SandboxKind::Cold);
}

#[test]
fn one_assignment_per_sandbox() {
    let mut world = World::new(1);
    let (standby, _) = world.ready_pool().remove(0);
    let (first, _) = world.submit(run("a"));
    let (second, step) = world.submit(run("b"));
    assert_eq!(world.run(&first).path(), Some(RunPath::Warm));
    assert_eq!(world.run(&second).path(), Some(RunPath::Cold));
    assert!(assignments(&step).is_empty(), "nothing more is sent to the committed standby");
    assert_eq!(world.sandbox(&standby.sandbox_id).run_id, Some(first));
}

#[test]
fn a_cold_sandbox_is_bound_before_it_connects_and_gets_the_assignment_when_it_does() {
    let mut world = World::new(0);
    let (run_id, step) = world.submit(run("a"));
    let cold = launches(&step).remove(0);
    let launch = step.effects.iter().position(|e| matches!(e, Effect::Launch { .. })).expect("a launch");
    assert!(assignments(&step).is_empty());
    assert_eq!(world.sandbox(&cold.sandbox_id).state, SandboxState::Assigned);
    assert!(launch < step.effects.len());
    let (_, conn, step) = world.connect(&cold.token);
    let sent = assignments(&step);
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].0, conn);
    assert_eq!(sent[0].1.execution_id, run_id);
}

/// Telling a cold sandbox its assignment starts delivery confirmation,
/// which revokes the standby credential: an agent still fetching its spec
/// with that credential would be refused. So the assignment waits until the
/// spec was served, or the agent says it is past preparing.
#[test]
fn a_cold_sandbox_is_told_only_once_its_agent_has_its_spec() {
    for how in ["spec", "ready"] {
        let mut world = World::new(0);
        let (run_id, step) = world.submit(run("a"));
        let cold = launches(&step).remove(0);
        let (_, conn, step) = world.connect_only(&cold.token);
        assert!(assignments(&step).is_empty(), "withheld while the agent may be fetching its spec");
        let step = world.heartbeat(conn, AgentState::Preparing);
        assert!(assignments(&step).is_empty());
        let step = match how {
            "spec" => {
                let step = world.machine.spec_served(&cold.sandbox_id);
                world.keep(step)
            }
            _ => world.heartbeat(conn, AgentState::Ready),
        };
        let sent = assignments(&step);
        assert_eq!((sent.len(), sent[0].0), (1, conn), "{how}");
        assert_eq!(sent[0].1.execution_id, run_id);
        let step = world.heartbeat(conn, AgentState::Ready);
        assert!(assignments(&step).is_empty(), "sent once");
    }
}

#[test]
fn the_assignment_is_sent_again_on_a_later_standby_connection_until_confirmed() {
    let mut world = World::new(1);
    let (standby, conn) = world.ready_pool().remove(0);
    let (_, step) = world.submit(run("a"));
    let first = assignments(&step).remove(0).1;
    world.machine.disconnected(conn);
    let (_, _, step) = world.connect(&standby.token);
    let again = assignments(&step).remove(0).1;
    assert_eq!(again, first, "the same execution and credential");
}

#[test]
fn assignment_sent_is_stamped_once() {
    let mut world = World::new(1);
    world.ready_pool();
    let (run_id, _) = world.submit(run("a"));
    world.advance(5);
    assert!(!world.machine.assignment_sent(world.now, &run_id).is_empty());
    let sent = world.run(&run_id).current().and_then(|a| a.assignment_sent_at);
    world.advance(5);
    assert!(world.machine.assignment_sent(world.now, &run_id).is_empty());
    assert_eq!(world.run(&run_id).current().and_then(|a| a.assignment_sent_at), sent);
}

// ---- confirmation -------------------------------------------------------------

#[test]
fn the_run_credential_connecting_revokes_the_standby_credential_and_replays_the_assignment() {
    let mut world = World::new(1);
    let (standby, standby_conn) = world.ready_pool().remove(0);
    let (run_id, step) = world.submit(run("a"));
    let assignment = assignments(&step).remove(0).1;
    world.advance(7);
    let (admission, run_conn, step) = world.connect(&assignment.run_credential);
    assert!(matches!(admission, Admission::Run { .. }));
    let standby_credential = world.sandbox(&standby.sandbox_id).standby_credential_id;
    let revoked = position(&step, revokes(&standby_credential));
    assert!(revoked < step.writes.len());
    assert_eq!(closes(&step), [standby_conn]);
    let replay = sends(&step, run_conn);
    assert_eq!(replay, [ServerMessage::Assignment(assignment.clone())]);
    let record = world.run(&run_id);
    assert_eq!(record.state, RunState::Confirmed);
    assert_eq!(record.current().and_then(|a| a.delivery_confirmed_at), Some(world.now));
    assert_eq!(world.machine.authenticate(standby.token.expose()), Err(Refusal::Unauthorized));
    // A reconnection with the run credential gets the replay again.
    world.machine.disconnected(run_conn);
    let (_, again, step) = world.connect(&assignment.run_credential);
    assert_eq!(sends(&step, again), [ServerMessage::Assignment(assignment)]);
    assert_eq!(
        world.run(&run_id).current().and_then(|a| a.delivery_confirmed_at),
        record.current().and_then(|a| a.delivery_confirmed_at)
    );
}

#[test]
fn a_connection_whose_credential_was_revoked_meanwhile_is_closed() {
    let mut world = World::new(1);
    let (standby, first) = world.ready_pool().remove(0);
    let (run_id, _) = world.submit(run("a"));
    assert_eq!(world.run(&run_id).path(), Some(RunPath::Warm));
    // Its agent reconnects: the new upgrade is admitted, then the
    // credential is revoked before the connection is set up.
    world.machine.disconnected(first);
    let (admission, _) = world.machine.claim_socket(world.now, 99, standby.token.expose()).expect("admitted");
    world.machine.cancel(world.now, &run_id).expect("cancelled");
    let step = world.machine.connected(world.now, 99, admission.credential_id(), &standby.token);
    assert_eq!(closes(&step), [99]);
}

// ---- fencing -------------------------------------------------------------------

#[test]
fn cancel_before_confirmation_withdraws_first_and_retires_the_sandbox() {
    let mut world = World::new(1);
    let (standby, conn) = world.ready_pool().remove(0);
    let (run_id, step) = world.submit(run("a"));
    let assignment = assignments(&step).remove(0).1;
    let credential_id = world.run(&run_id).current().map(|a| a.credential_id.clone()).expect("an attempt");
    let (step, state) = world.machine.cancel(world.now, &run_id).expect("cancelled");
    assert_eq!(state, RunState::Cancelled);
    let finishing =
        |w: &Write| matches!(w, Write::Credential(c) if c.id == credential_id && c.state == CredentialState::Finishing);
    assert_eq!(position(&step, finishing), 0, "the run credential is withdrawn first");
    assert!(matches!(sends(&step, conn).as_slice(), [ServerMessage::Cancel(c)] if c.execution_id == run_id));
    assert_eq!(retires(&step), std::slice::from_ref(&standby.sandbox_id));
    // Amendment 8: only the run's events and log, until the agent is done.
    assert_eq!(world.machine.authenticate(assignment.run_credential.expose()), Err(Refusal::Ended));
    assert!(world.machine.check(assignment.run_credential.expose(), Call::Report).is_ok());
    assert_eq!(world.machine.check(assignment.run_credential.expose(), Call::Socket), Err(Refusal::Ended));
    assert_eq!(world.machine.authenticate(standby.token.expose()), Err(Refusal::Gone));
    let record = world.run(&run_id);
    assert_eq!(record.current().and_then(|a| a.outcome), Some(AttemptOutcome::Cancelled));
    assert_eq!(world.sandbox(&standby.sandbox_id).state, SandboxState::Retired);
    assert_eq!(launches(&step).len(), 1, "the pool is refilled");
}

#[test]
fn cancel_of_a_running_run_asks_the_agent_and_waits_for_its_report() {
    let mut world = World::new(1);
    world.ready_pool();
    let (run_id, step) = world.submit(run("a"));
    let assignment = assignments(&step).remove(0).1;
    let (_, run_conn, _) = world.connect(&assignment.run_credential);
    world.event(&run_id, "e1", EventKind::Started);
    assert_eq!(world.run(&run_id).state, RunState::Running);
    let (step, state) = world.machine.cancel(world.now, &run_id).expect("cancelling");
    assert_eq!(state, RunState::Cancelling);
    assert!(matches!(sends(&step, run_conn).as_slice(), [ServerMessage::Cancel(_)]));
    let token = assignment.run_credential.expose();
    assert!(world.machine.check(token, Call::Report).is_ok(), "it can still report");
    assert_eq!(world.machine.authenticate(token), Err(Refusal::Ended), "and do nothing else (amendment 8)");
    let step = world.event(&run_id, "e2", EventKind::Cancelled);
    assert_eq!(world.run(&run_id).state, RunState::Cancelled);
    assert_eq!(world.machine.check(token, Call::Report), Err(Refusal::Ended), "its report was the last");
    assert_eq!(closes(&step), [run_conn]);
}

#[test]
fn cancel_rules_for_queued_finished_and_unknown_runs() {
    let mut world = World::new(1);
    world.machine.shutdown();
    let (queued, _) = world.submit(run("a"));
    assert_eq!(world.run(&queued).state, RunState::Queued);
    let (_, state) = world.machine.cancel(world.now, &queued).expect("cancelled");
    assert_eq!(state, RunState::Cancelled);
    assert_eq!(world.machine.cancel(world.now, &queued).map(|(_, s)| s), Ok(RunState::Cancelled), "idempotent");
    assert_eq!(
        world.machine.cancel(world.now, "exe_nope").map(|(_, s)| s),
        Err(CancelError::NotFound("exe_nope".into()))
    );

    let mut world = World::new(1);
    world.ready_pool();
    let (run_id, _) = world.submit(run("a"));
    world.event(&run_id, "s", EventKind::Started);
    world.event(&run_id, "x", EventKind::Exited { code: 3 });
    assert!(matches!(
        world.machine.cancel(world.now, &run_id),
        Err(CancelError::Finished { state: RunState::Exited, .. })
    ));
}

#[test]
fn a_committed_standby_that_exits_before_confirming_is_written_off_and_the_run_requeued_cold() {
    let mut world = World::new(2);
    let pool = world.ready_pool();
    let (standby, _) = pool[0].clone();
    let (run_id, step) = world.submit(run("a"));
    let assignment = assignments(&step).remove(0).1;
    let first_credential = world.run(&run_id).current().map(|a| a.credential_id.clone()).expect("attempt");
    let step = world.machine.sandbox_exited(world.now, &standby.sandbox_id, None);
    let step = world.keep(step);
    assert_eq!(position(&step, revokes(&first_credential)), 0);
    // Both credentials are now refused with 401: the sandbox can neither
    // start the run nor come back as a standby.
    assert_eq!(world.machine.authenticate(assignment.run_credential.expose()), Err(Refusal::Unauthorized));
    assert_eq!(world.machine.authenticate(standby.token.expose()), Err(Refusal::Unauthorized));
    let record = world.run(&run_id);
    assert_eq!(record.attempts.len(), 2);
    assert_eq!(record.attempts[0].outcome, Some(AttemptOutcome::Requeued));
    assert_eq!(record.attempts[1].path, RunPath::Cold, "one pre-warmed attempt only, though a standby is ready");
    assert_eq!(record.state, RunState::Committed);
    assert_eq!(launches(&step).len(), 2, "the cold sandbox and the pool's replacement");
}

#[test]
fn a_sandbox_that_dies_after_confirmation_fails_its_run_rather_than_run_it_twice() {
    let mut world = World::new(1);
    let (standby, _) = world.ready_pool().remove(0);
    let (run_id, step) = world.submit(run("a"));
    let assignment = assignments(&step).remove(0).1;
    world.connect(&assignment.run_credential);
    assert_eq!(world.run(&run_id).state, RunState::Confirmed);
    // It may have started the run; `started` is still on its way.
    let step = world.machine.sandbox_exited(world.now, &standby.sandbox_id, None);
    let record = world.run(&run_id);
    assert_eq!(record.state, RunState::Failed);
    assert_eq!(record.attempts.len(), 1, "not sent to another sandbox");
    assert!(record.error.as_deref().is_some_and(|e| e.contains("not run again")), "{:?}", record.error);
    assert_eq!(world.machine.authenticate(assignment.run_credential.expose()), Err(Refusal::Unauthorized));
    assert!(
        launches(&step).iter().all(|l| world.sandbox(&l.sandbox_id).kind == SandboxKind::Warm),
        "no cold sandbox for it"
    );
}

#[test]
fn a_committed_standby_that_stops_heartbeating_is_written_off() {
    let mut world = World::new(1);
    let (standby, conn) = world.ready_pool().remove(0);
    let (run_id, _) = world.submit(run("a"));
    world.advance(2 * SECOND);
    world.heartbeat(conn, AgentState::Ready);
    world.advance(3 * SECOND);
    assert!(world.tick().writes.iter().all(|w| !matches!(w, Write::Run(_))), "not yet silent");
    world.advance(1);
    let step = world.tick();
    assert!(retires(&step).contains(&standby.sandbox_id));
    assert!(closes(&step).contains(&conn));
    let record = world.run(&run_id);
    assert_eq!(record.attempts[0].outcome, Some(AttemptOutcome::Requeued));
    assert_eq!(record.attempts[1].path, RunPath::Cold);
}

#[test]
fn a_confirmed_run_is_not_written_off_for_silence() {
    let mut world = World::new(1);
    world.ready_pool();
    let (run_id, step) = world.submit(run("a"));
    let assignment = assignments(&step).remove(0).1;
    world.connect(&assignment.run_credential);
    world.advance(60 * SECOND);
    world.tick();
    assert_eq!(world.run(&run_id).state, RunState::Confirmed);
}

#[test]
fn a_requeueable_install_failure_requeues_to_a_cold_sandbox_once_warm() {
    let mut world = World::new(2);
    let pool = world.ready_pool();
    let (run_id, step) = world.submit(run("a"));
    let assignment = assignments(&step).remove(0).1;
    world.connect(&assignment.run_credential);
    let failure = EventKind::install_failed(Stage::SamePreparation, Cause::FingerprintMismatch, "fingerprint mismatch");
    let step = world.event(&run_id, "f1", failure);
    let revoked = position(&step, revokes(&world.run(&run_id).attempts[0].credential_id));
    let requeued = position(&step, |w| matches!(w, Write::Run(r) if r.attempts.len() == 2));
    assert!(revoked < requeued, "fenced before the next attempt");
    assert!(retires(&step).contains(&pool[0].0.sandbox_id));
    let record = world.run(&run_id);
    assert_eq!(record.attempts[0].outcome, Some(AttemptOutcome::Requeued));
    assert!(record.attempts[0].reason.as_deref().is_some_and(|r| r.contains("fingerprint mismatch")));
    assert_eq!(record.attempts[1].path, RunPath::Cold);
    assert_eq!(record.attempts.iter().filter(|a| a.path == RunPath::Warm).count(), 1);
    let cold =
        launches(&step).into_iter().find(|l| l.sandbox_id == record.attempts[1].sandbox_id).expect("cold launch");
    assert_eq!(world.sandbox(&cold.sandbox_id).kind, SandboxKind::Cold);
    // The retry on the cold sandbox succeeds.
    let (_, _, step) = world.connect(&cold.token);
    let second = assignments(&step).remove(0).1;
    assert_eq!(second.execution_id, run_id);
    assert_ne!(second.run_credential, assignment.run_credential);
    world.connect(&second.run_credential);
    world.event(&run_id, "s", EventKind::Started);
    world.event(&run_id, "x", EventKind::Exited { code: 0 });
    let record = world.run(&run_id);
    assert_eq!((record.state, record.exit_code, record.path()), (RunState::Exited, Some(0), Some(RunPath::Cold)));
}

#[test]
fn a_final_install_failure_fails_the_run_with_the_agents_message() {
    let mut world = World::new(1);
    world.ready_pool();
    let (run_id, _) = world.submit(run("a"));
    let failure = EventKind::install_failed(Stage::Check, Cause::InvalidRun, "no such directory `nope`");
    let step = world.event(&run_id, "f", failure);
    let record = world.run(&run_id);
    assert_eq!(record.state, RunState::Failed);
    assert_eq!(record.attempts.len(), 1);
    assert!(record.error.as_deref().is_some_and(|e| e.contains("no such directory `nope`")), "{:?}", record.error);
    assert_eq!(launches(&step).len(), 1, "only the pool's replacement");
}

#[test]
fn requeues_stop_at_max_attempts() {
    let mut world = World::new(0);
    let (run_id, mut step) = world.submit(run("a"));
    for n in 1..=3 {
        let cold = launches(&step).remove(0);
        world.connect(&cold.token);
        let failure = EventKind::install_failed(Stage::Secrets, Cause::Network, format!("timeout {n}"));
        step = world.event(&run_id, &format!("f{n}"), failure);
    }
    let record = world.run(&run_id);
    assert_eq!(record.state, RunState::Failed);
    assert_eq!(record.attempts.len(), 3);
    assert!(record.error.as_deref().is_some_and(|e| e.contains("gave up after 3 attempts") && e.contains("timeout 3")));
}

#[test]
fn a_run_whose_sandbox_dies_while_running_fails() {
    let mut world = World::new(1);
    let (standby, _) = world.ready_pool().remove(0);
    let (run_id, _) = world.submit(run("a"));
    world.event(&run_id, "s", EventKind::Started);
    world.machine.sandbox_exited(world.now, &standby.sandbox_id, Some(1));
    let record = world.run(&run_id);
    assert_eq!(record.state, RunState::Failed);
    assert_eq!(record.attempts.len(), 1, "a started run is never started again");
}

// ---- events and logs ---------------------------------------------------------------

#[test]
fn events_are_deduplicated_by_event_id() {
    let mut world = World::new(1);
    world.ready_pool();
    let (run_id, _) = world.submit(run("a"));
    let first = world.event(&run_id, "same", EventKind::Started);
    assert!(first.writes.iter().any(|w| matches!(w, Write::Event(_))));
    assert!(world.event(&run_id, "same", EventKind::Started).is_empty());
    let exited = world.event(&run_id, "x", EventKind::Exited { code: 7 });
    assert_eq!(world.run(&run_id).exit_code, Some(7));
    assert!(!retires(&exited).is_empty(), "the finished sandbox is retired");
    assert!(world.event(&run_id, "x", EventKind::Exited { code: 9 }).is_empty());
    assert_eq!(world.run(&run_id).exit_code, Some(7));
}

#[test]
fn log_offsets_store_each_byte_once_and_refuse_gaps() {
    let mut world = World::new(0);
    let (exe, _) = world.submit(run("a"));
    let exe = exe.as_str();
    let (step, len) = world.machine.log(exe, 0, 0, b"hello ").expect("appended");
    assert_eq!(len, 6);
    assert!(matches!(step.writes.as_slice(), [Write::Log { offset: 0, data, .. }] if data == b"hello "));
    let (step, len) = world.machine.log(exe, 0, 0, b"hello ").expect("a retried chunk is acknowledged");
    assert_eq!(len, 6);
    assert!(step.writes.is_empty(), "and stored once");
    let (step, len) = world.machine.log(exe, 3, 0, b"lo world").expect("overlapping");
    assert_eq!(len, 11);
    assert!(matches!(step.writes.as_slice(), [Write::Log { offset: 6, data, .. }] if data == b"world"));
    assert_eq!(
        world.machine.log(exe, 12, 0, b"!").map(|(_, n)| n),
        Err(LogError::Conflict { offset: 12, dropped: 0, received: 11 })
    );
}

// ---- credentials ---------------------------------------------------------------------

#[test]
fn refusals_distinguish_gone_from_unauthorized() {
    let mut world = World::new(1);
    let (standby, _) = world.ready_pool().remove(0);
    assert_eq!(world.machine.authenticate("sby_unknown_secret"), Err(Refusal::Gone));
    assert_eq!(world.machine.authenticate("run_unknown_secret"), Err(Refusal::Unauthorized));
    assert_eq!(world.machine.authenticate("not a token"), Err(Refusal::Unauthorized));
    let (_, id, _) = {
        let text = standby.token.expose().to_owned();
        let mut parts = text.splitn(3, '_');
        (parts.next().map(str::to_owned), parts.next().map(str::to_owned).expect("an id"), ())
    };
    assert_eq!(world.machine.authenticate(&format!("sby_{id}_wrong")), Err(Refusal::Unauthorized));
    assert_eq!(world.machine.authenticate(&format!("run_{id}_wrong")), Err(Refusal::Unauthorized), "kind mismatch");
}

// ---- restarts --------------------------------------------------------------------------

#[test]
fn a_restart_probes_sandboxes_and_resumes_stopped_standbys_with_a_new_credential() {
    let mut world = World::new(1);
    let (standby, _) = world.ready_pool().remove(0);
    let (done, _) = world.submit(run("a"));
    world.event(&done, "s", EventKind::Started);
    world.event(&done, "x", EventKind::Exited { code: 0 });
    let replacement = world
        .machine
        .sandbox_views(world.now)
        .into_iter()
        .find(|v| v.record.state == SandboxState::Standby)
        .expect("a replacement");
    let snapshot = world.snapshot();
    let (mut machine, step) =
        Dispatch::restore(config(1), Box::new(CountingMint::starting_at(1000)), snapshot, world.now);
    assert!(machine.run(&done).is_none(), "a finished run is not loaded");
    assert_eq!(machine.metrics().runs.get(&(RunState::Exited, Some(RunPath::Warm))), Some(&1), "but counted");
    let probes: Vec<&Effect> = step.effects.iter().filter(|e| matches!(e, Effect::Probe { .. })).collect();
    assert_eq!(probes.len(), 1, "only the live standby is probed: {probes:?}");
    assert!(launches(&step).is_empty(), "the live standby still counts for the pool");
    let _ = standby;
    let step = machine.probed(world.now, &replacement.record.id, Found::Stopped);
    let relaunch = launches(&step).remove(0);
    assert_eq!(relaunch.sandbox_id, replacement.record.id);
    assert!(step.effects.iter().any(|e| matches!(e, Effect::Launch { create: false, .. })));
    assert!(matches!(machine.authenticate(relaunch.token.expose()), Ok(Admission::Standby { .. })));
    // Events survive: a retried event from before the restart is a duplicate.
    let again = machine.event(world.now, &done, 1, Event { event_id: "x".into(), kind: EventKind::Exited { code: 0 } });
    assert!(again.is_empty());
}

#[test]
fn a_restart_writes_off_a_committed_sandbox_that_stopped() {
    let mut world = World::new(1);
    let (standby, _) = world.ready_pool().remove(0);
    let (run_id, _) = world.submit(run("a"));
    let (mut machine, _) =
        Dispatch::restore(config(1), Box::new(CountingMint::starting_at(1000)), world.snapshot(), world.now);
    let step = machine.probed(world.now, &standby.sandbox_id, Found::Stopped);
    let record = machine.run(&run_id).expect("the run").clone();
    assert_eq!(record.attempts[0].outcome, Some(AttemptOutcome::Requeued));
    assert_eq!(record.attempts[1].path, RunPath::Cold);
    assert!(!launches(&step).is_empty());
}

#[test]
fn after_a_restart_the_assignment_is_resent_with_a_new_run_credential() {
    let mut world = World::new(0);
    let (run_id, step) = world.submit(run("a"));
    let cold = launches(&step).remove(0);
    let (mut machine, _) =
        Dispatch::restore(config(0), Box::new(CountingMint::starting_at(1000)), world.snapshot(), world.now);
    machine.probed(world.now, &cold.sandbox_id, Found::Running);
    let (admission, _) = machine.claim_socket(world.now, 1, cold.token.expose()).expect("admitted");
    let step = machine.connected(world.now, 1, admission.credential_id(), &cold.token);
    assert!(assignments(&step).is_empty(), "this server has not seen it fetch its spec");
    // Its first heartbeat on the connection says it is past preparing.
    let step = machine.heartbeat(world.now, 1, AgentState::Ready);
    let assignment = assignments(&step).remove(0).1;
    assert_eq!(assignment.execution_id, run_id);
    assert!(matches!(machine.authenticate(assignment.run_credential.expose()), Ok(Admission::Run { .. })));
}

#[test]
fn while_draining_nothing_is_dispatched_and_exits_change_nothing() {
    let mut world = World::new(1);
    let (standby, _) = world.ready_pool().remove(0);
    world.machine.shutdown();
    let (run_id, step) = world.submit(run("a"));
    assert!(launches(&step).is_empty());
    assert_eq!(world.run(&run_id).state, RunState::Queued);
    let step = world.machine.sandbox_exited(world.now, &standby.sandbox_id, Some(0));
    assert!(step.effects.is_empty());
    assert_eq!(world.sandbox(&standby.sandbox_id).state, SandboxState::Standby);
}

#[test]
fn metrics_count_runs_by_state_and_path() {
    let mut world = World::new(1);
    let (_, conn) = world.ready_pool().remove(0);
    let (warm, _) = world.submit(run("a"));
    let (cold, _) = world.submit(run("b"));
    world.advance(10);
    world.machine.assignment_sent(world.now, &warm);
    world.advance(250);
    world.event(&warm, "s", EventKind::Started);
    let metrics = world.machine.metrics();
    assert_eq!(metrics.runs.get(&(RunState::Running, Some(RunPath::Warm))), Some(&1));
    assert_eq!(metrics.runs.get(&(RunState::Committed, Some(RunPath::Cold))), Some(&1));
    assert_eq!(metrics.assignment_to_start_ms, [250]);
    assert_eq!(metrics.connected_standbys, 1);
    let _ = (cold, conn);
}

mod admission;
mod bounds;
mod lifecycle;
