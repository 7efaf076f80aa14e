//! The machine's rules, tested without IO: a [`World`] drives the machine
//! with a clock and keeps every write, from which a restart's snapshot is
//! built. One file per input, as the machine is split.

use std::collections::BTreeMap;

use standby_protocol::{Assignment, Cause, Event, EventKind, Repo, Run, Stage, Workspace, fingerprint};

use super::*;
use crate::credential::CountingMint;
use crate::model::{AttemptOutcome, IdempotencyRecord, SandboxKind};
use crate::policy::AutoStop;
use crate::provider::Found;

const SECOND: i64 = 1000;

fn config(pool_size: usize) -> RulesConfig {
    RulesConfig {
        heartbeat_interval: Duration::from_secs(1),
        pool_size,
        max_attempts: 3,
        launch_timeout: Duration::from_secs(10),
        run_silence: Duration::from_secs(120),
        linger: Duration::from_secs(5),
        pool_workspace: Workspace::default(),
        pool_fingerprint: fingerprint(&Workspace::default()),
        pool_policy: PoolPolicy::default(),
        bounds: RunBounds::default(),
        snapshots: false,
        trace: false,
    }
}

fn run(command: &str) -> Run {
    Run { command: vec![command.to_owned()], ..Run::default() }
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
            Effect::Send { conn, message: ServerMessage::Assignment(assignment) } => {
                Some((*conn, Assignment::clone(assignment)))
            }
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
    machine: Rules,
    now: Millis,
    next_conn: ConnId,
    writes: Vec<Write>,
}

impl World {
    fn new(pool_size: usize) -> Self {
        Self::with(config(pool_size))
    }

    fn with(config: RulesConfig) -> Self {
        Self {
            machine: Rules::new(config, Box::new(CountingMint::default())),
            now: Millis(1_000_000),
            next_conn: 1,
            writes: Vec::new(),
        }
    }

    fn keep(&mut self, step: Step) -> Step {
        self.machine.sandboxes.check();
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
        let step = self.machine.connected(self.now, conn, (admission.credential_id(), token), None);
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
        let step = self.machine.event(self.now, run_id, attempt, Event::new(id, kind));
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
        let mut keys: BTreeMap<String, IdempotencyRecord> = BTreeMap::new();
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
                Write::Idempotency(record) => {
                    keys.insert(record.key.clone(), (**record).clone());
                }
                Write::ForgetIdempotency { through } => keys.retain(|_, kept| kept.created_at > *through),
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
            idempotency: keys.into_values().collect(),
        }
    }
}

/// A run bound warm to the pool's oldest standby and told its assignment.
struct Warm {
    standby: Launched,
    conn: ConnId,
    run_id: String,
    assignment: Assignment,
}

impl World {
    /// Readies the pool and submits a run, which its oldest standby takes.
    fn warm_run(&mut self) -> Warm {
        let (standby, conn) = self.ready_pool().remove(0);
        let (run_id, step) = self.submit(run("a"));
        let assignment = assignments(&step).remove(0).1;
        Warm { standby, conn, run_id, assignment }
    }
}

/// Index of the first write matching `predicate`.
fn position(step: &Step, predicate: impl Fn(&Write) -> bool) -> usize {
    step.writes.iter().position(predicate).expect("a matching write")
}

fn revokes(credential_id: &str) -> impl Fn(&Write) -> bool + '_ {
    move |write| matches!(write, Write::Credential(c) if c.id == credential_id && c.state == CredentialState::Revoked)
}

// ---- turns of threads ---------------------------------------------------------

const MINUTE: Duration = Duration::from_secs(60);

/// A config with a running cap, a one-minute warm idle window and Tier 1
/// parking.
fn policy(pool_size: usize, running_cap: usize) -> RulesConfig {
    let mut config = config(pool_size);
    config.pool_policy = PoolPolicy {
        running_cap,
        max_preparing: 0,
        standby_ttl: Duration::ZERO,
        warm_idle: MINUTE,
        park_stopped: true,
        auto_stop: AutoStop { minutes: 1, minute: MINUTE },
        resume_timeout: Duration::from_secs(30),
    };
    config
}

fn turn(world: &mut World, thread: &str) -> (String, Step) {
    let (step, id) = world.machine.submit_turn(world.now, run("turn"), request(), Some(thread.to_owned()));
    (id, world.keep(step))
}

/// The assignment `step` delivers: sent at once (a standby, a parked
/// sandbox), or on the first connection of the sandbox it launches.
fn deliver(world: &mut World, step: &Step) -> Assignment {
    if let Some((_, assignment)) = assignments(step).into_iter().next() {
        return assignment;
    }
    let launched = launches(step).into_iter().next().expect("a launch or an assignment");
    let (_, _, step) = world.connect(&launched.token);
    assignments(&step).remove(0).1
}

/// A turn of a thread, bound and told its assignment.
struct Bound {
    run_id: String,
    /// The step of its submission.
    step: Step,
    assignment: Assignment,
    sandbox_id: String,
}

/// Submits a turn of `thread` and delivers its assignment.
fn bound_turn(world: &mut World, thread: &str) -> Bound {
    let (run_id, step) = turn(world, thread);
    let assignment = deliver(world, &step);
    let sandbox_id = world.run(&run_id).current().expect("bound").sandbox_id.clone();
    Bound { run_id, step, assignment, sandbox_id }
}

/// The agent confirms, starts and finishes the run: the step of `exited`.
fn finish(world: &mut World, assignment: &Assignment) -> Step {
    let run_id = assignment.execution_id.clone();
    world.connect(&assignment.run_credential);
    world.event(&run_id, &format!("{run_id}-started"), EventKind::Started);
    world.event(&run_id, &format!("{run_id}-exited"), EventKind::Exited { code: 0 })
}

fn resumes(step: &Step) -> Vec<(String, Secret, u32)> {
    step.effects
        .iter()
        .filter_map(|effect| match effect {
            Effect::Resume { sandbox_id, token, auto_stop, .. } => {
                Some((sandbox_id.clone(), token.clone(), *auto_stop))
            }
            _ => None,
        })
        .collect()
}

fn parks(step: &Step) -> Vec<(String, u32)> {
    step.effects
        .iter()
        .filter_map(|effect| match effect {
            Effect::Park { sandbox_id, auto_stop, .. } => Some((sandbox_id.clone(), *auto_stop)),
            _ => None,
        })
        .collect()
}

fn stops(step: &Step) -> Vec<String> {
    step.effects
        .iter()
        .filter_map(|e| if let Effect::Stop { sandbox_id } = e { Some(sandbox_id.clone()) } else { None })
        .collect()
}

fn exited(world: &mut World, sandbox_id: &str) -> Step {
    let step = world.machine.sandbox_exited(world.now, sandbox_id, Some(0));
    world.keep(step)
}

/// The fresh agent of a resumed sandbox connects and says `ready`.
fn ready(world: &mut World, token: &Secret) -> Step {
    let (_, conn, _) = world.connect(token);
    world.heartbeat(conn, AgentState::Ready)
}

/// Like [`ready`], and the connection, to heartbeat on.
fn ready_conn(world: &mut World, token: &Secret) -> ConnId {
    let (_, conn, _) = world.connect(token);
    world.heartbeat(conn, AgentState::Ready);
    conn
}

fn park_mode(world: &World, sandbox_id: &str) -> Option<ParkMode> {
    world.sandbox(sandbox_id).park.map(|park| park.mode)
}

/// Turn 1 of `thread` on a cold sandbox, finished, its agent exited and a
/// fresh one ready (Tier 2): the sandbox id.
fn parked_running(world: &mut World, thread: &str) -> String {
    let Bound { assignment, sandbox_id, .. } = bound_turn(world, thread);
    let step = finish(world, &assignment);
    assert_eq!(parks(&step).len(), 1, "kept for the thread");
    let step = exited(world, &sandbox_id);
    let (_, token, _) = resumes(&step).remove(0);
    ready(world, &token);
    sandbox_id
}

mod admission;
mod bounds;
mod connections;
mod events;
mod idempotency;
mod input;
mod logs;
mod placement;
mod pool;
mod queries;
mod resume;
mod runs;
mod sandboxes;
mod snapshots;
mod threads;
mod ticks;

impl Step {
    /// No writes and no effects.
    fn is_empty(&self) -> bool {
        self.writes.is_empty() && self.effects.is_empty()
    }
}
