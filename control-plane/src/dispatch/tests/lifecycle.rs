//! The pool policy and the thread tiers, as rules of the pure machine.

use std::collections::{BTreeSet, HashMap, VecDeque};

use super::*;
use crate::model::{ParkMode, Wait};
use crate::policy::AutoStop;

const MINUTE: Duration = Duration::from_secs(60);

fn lifecycle(pool_size: usize, running_cap: usize) -> DispatchConfig {
    let mut config = config(pool_size);
    config.pool_policy = PoolPolicy {
        running_cap,
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
            Effect::Resume { sandbox_id, token, auto_stop } => Some((sandbox_id.clone(), token.clone(), *auto_stop)),
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
    let (_, step) = turn(world, thread);
    let assignment = deliver(world, &step);
    let sandbox_id = world.run(&assignment.execution_id).current().expect("bound").sandbox_id.clone();
    let step = finish(world, &assignment);
    assert_eq!(parks(&step).len(), 1, "kept for the thread");
    let step = exited(world, &sandbox_id);
    let (_, token, _) = resumes(&step).remove(0);
    ready(world, &token);
    sandbox_id
}

// ---- the running cap -------------------------------------------------------------

/// Plays every agent: launched sandboxes connect (standbys say `ready`),
/// assignments are confirmed, started and finished, and agents exit when
/// their run ends or they are retired or stopped. Counts live agents.
struct Sim {
    world: World,
    alive: BTreeSet<String>,
    actions: VecDeque<Action>,
    committed: Vec<String>,
    most_alive: usize,
    /// Runs whose assignment an agent took (replays are not new runs).
    taken: BTreeSet<String>,
    /// Standby connections, heartbeating `ready` while their agent lives.
    standbys: Vec<(String, ConnId)>,
}

#[derive(Debug)]
enum Action {
    Connect(String, Secret),
    Run(Assignment),
    Exit(String),
}

impl Sim {
    fn new(config: DispatchConfig) -> Self {
        Self {
            world: World::with(config),
            alive: BTreeSet::new(),
            actions: VecDeque::new(),
            committed: Vec::new(),
            most_alive: 0,
            taken: BTreeSet::new(),
            standbys: Vec::new(),
        }
    }

    /// Time passes: the idle agents heartbeat, then the machine ticks.
    fn advance(&mut self, millis: i64) {
        self.world.advance(millis);
        self.standbys.retain(|(sandbox_id, _)| self.alive.contains(sandbox_id));
        for (_, conn) in self.standbys.clone() {
            let step = self.world.machine.heartbeat(self.world.now, conn, AgentState::Ready);
            self.step(step);
        }
        let step = self.world.tick();
        self.observe(&step);
        self.settle();
    }

    fn cap(&self) -> usize {
        self.world.machine.config.pool_policy.running_cap
    }

    /// Records what `step` asks of the agents, and checks the cap: neither
    /// the agents alive nor the machine's own count may exceed it.
    fn observe(&mut self, step: &Step) {
        for write in &step.writes {
            if let Write::Run(run) = write
                && run.state == RunState::Committed
                && run.attempts.len() == 1
                && !self.committed.contains(&run.id)
            {
                self.committed.push(run.id.clone());
            }
        }
        for effect in &step.effects {
            match effect {
                Effect::Launch { sandbox_id, token, .. } | Effect::Resume { sandbox_id, token, .. } => {
                    assert!(self.alive.insert(sandbox_id.clone()), "{sandbox_id} launched twice at once");
                    self.actions.push_back(Action::Connect(sandbox_id.clone(), token.clone()));
                }
                Effect::Send { message: ServerMessage::Assignment(assignment), .. } => {
                    self.actions.push_back(Action::Run(assignment.clone()));
                }
                Effect::Retire { sandbox_id, .. } | Effect::Stop { sandbox_id } | Effect::Park { sandbox_id, .. } => {
                    self.actions.push_back(Action::Exit(sandbox_id.clone()));
                }
                _ => {}
            }
        }
        self.most_alive = self.most_alive.max(self.alive.len());
        let cap = self.cap();
        assert!(self.alive.len() <= cap, "{} agents alive, cap {cap}", self.alive.len());
        assert!(self.world.machine.running_count() <= cap, "the machine counts past the cap");
    }

    fn step(&mut self, step: Step) {
        let step = self.world.keep(step);
        self.observe(&step);
    }

    fn settle(&mut self) {
        while let Some(action) = self.actions.pop_front() {
            match action {
                Action::Connect(sandbox_id, token) => {
                    if !self.alive.contains(&sandbox_id) || self.world.machine.authenticate(token.expose()).is_err() {
                        continue;
                    }
                    let (_, conn, step) = self.world.connect(&token);
                    self.observe(&step);
                    self.standbys.push((sandbox_id, conn));
                    let step = self.world.machine.heartbeat(self.world.now, conn, AgentState::Ready);
                    self.step(step);
                }
                Action::Run(assignment) => {
                    let fresh = self.taken.insert(assignment.execution_id.clone());
                    if !fresh || self.world.machine.authenticate(assignment.run_credential.expose()).is_err() {
                        continue;
                    }
                    let run_id = assignment.execution_id.clone();
                    let (_, _, step) = self.world.connect(&assignment.run_credential);
                    self.observe(&step);
                    let attempt = self.world.run(&run_id).attempts.len() as u32;
                    let sandbox_id = self.world.run(&run_id).current().expect("bound").sandbox_id.clone();
                    for (n, kind) in [EventKind::Started, EventKind::Exited { code: 0 }].into_iter().enumerate() {
                        let event = Event { event_id: format!("{run_id}-{n}"), kind };
                        let step = self.world.machine.event(self.world.now, &run_id, attempt, event);
                        self.step(step);
                    }
                    // The agent exits once its run is reported.
                    self.actions.push_back(Action::Exit(sandbox_id));
                }
                Action::Exit(sandbox_id) => {
                    if self.alive.remove(&sandbox_id) {
                        let step = self.world.machine.sandbox_exited(self.world.now, &sandbox_id, Some(0));
                        self.step(step);
                    }
                }
            }
        }
    }
}

#[test]
fn a_burst_never_exceeds_the_running_cap_and_every_run_waits_in_order_and_completes() {
    let mut sim = Sim::new(lifecycle(2, 4));
    let step = sim.world.tick();
    sim.observe(&step);
    sim.settle();
    let mut ids = Vec::new();
    for _ in 0..50 {
        let (id, step) = sim.world.submit(run("true"));
        sim.observe(&step);
        ids.push(id);
    }
    // Two warm, two cold, the rest wait: the wait is in the run's state.
    let waiting = sim.world.run(&ids[4]);
    assert_eq!(waiting.state, RunState::Waiting);
    assert!(
        matches!(&waiting.wait, Some(Wait { reason, for_slot: true, .. }) if reason.contains("running cap of 4")),
        "{:?}",
        waiting.wait
    );
    sim.settle();
    for id in &ids {
        let run = sim.world.run(id);
        assert_eq!((run.state, run.exit_code), (RunState::Exited, Some(0)), "{id}");
        assert_eq!(run.wait, None);
    }
    assert_eq!(sim.committed, ids, "runs are bound in the order they were submitted");
    assert_eq!(sim.most_alive, 4, "the cap is used, not exceeded");
    // The pool fills again once nothing waits.
    let step = sim.world.tick();
    sim.observe(&step);
    sim.settle();
    let ready = sim.world.machine.sandbox_views(sim.world.now).iter().filter(|v| v.candidate).count();
    assert_eq!(ready, 2);
}

#[test]
fn runs_come_before_standbys_at_the_cap() {
    let mut world = World::with(lifecycle(2, 2));
    world.ready_pool();
    let (first, _) = world.submit(run("a"));
    let (second, _) = world.submit(run("b"));
    let (third, step) = world.submit(run("c"));
    assert!(launches(&step).is_empty(), "no slot: no cold sandbox");
    assert_eq!(world.run(&third).state, RunState::Waiting);
    assert!(launches(&world.tick()).is_empty(), "nor a standby while a run waits");
    for id in [&first, &second] {
        assert_eq!(world.run(id).path(), Some(RunPath::Warm));
    }
}

#[test]
fn a_run_that_cannot_take_a_standby_gets_one_retired_to_make_room() {
    let mut config = lifecycle(1, 1);
    config.pool_policy.warm_idle = Duration::ZERO;
    let mut world = World::with(config);
    let pool = world.ready_pool();
    let (first, step) = turn(&mut world, "t1");
    let assignment = deliver(&mut world, &step);
    let kept = pool[0].0.sandbox_id.clone();
    finish(&mut world, &assignment);
    assert_eq!(park_mode(&world, &kept), Some(ParkMode::Stopped), "Tier 1 at once");
    let step = exited(&mut world, &kept);
    let standby = launches(&step).remove(0);
    ready(&mut world, &standby.token);
    assert_eq!(world.run(&first).state, RunState::Exited);
    // The follow-up needs a slot to start its sandbox; the standby holds
    // the only one, and the follow-up cannot use a standby.
    let (second, step) = turn(&mut world, "t1");
    assert_eq!(world.run(&second).state, RunState::Waiting);
    assert_eq!(retires(&step), std::slice::from_ref(&standby.sandbox_id), "the standby makes room");
    let step = exited(&mut world, &standby.sandbox_id);
    assert_eq!(resumes(&step).len(), 1);
    assert_eq!(world.run(&second).state, RunState::Resuming);
    assert!(launches(&step).is_empty(), "no standby while the run waits for its sandbox");
}

// ---- the standby TTL ------------------------------------------------------------------

#[test]
fn ttl_replacement_keeps_min_ready_standbys_ready() {
    let mut config = lifecycle(2, 3);
    config.pool_policy.standby_ttl = Duration::from_secs(100);
    let mut sim = Sim::new(config);
    let step = sim.world.tick();
    sim.observe(&step);
    sim.settle();
    let first: Vec<SandboxRecord> = sim.world.machine.sandboxes.values().map(|live| live.record.clone()).collect();
    assert_eq!(first.len(), 2);
    assert_ne!(first[0].expires_at, first[1].expires_at, "jittered: a pool made at once does not expire at once");
    for _ in 0..400 {
        sim.advance(SECOND);
        let ready = sim.world.machine.sandbox_views(sim.world.now).iter().filter(|view| view.candidate).count();
        assert!(ready >= 2, "only {ready} ready standbys at {:?}", sim.world.now);
    }
    let reasons: Vec<String> =
        sim.world.machine.sandboxes.values().filter_map(|live| live.record.retire_reason.clone()).collect();
    assert!(reasons.len() >= 6, "standbys were replaced: {reasons:?}");
    assert!(reasons.iter().all(|reason| reason == "standby TTL: replaced"), "{reasons:?}");
    for live in sim.world.machine.sandboxes.values().filter(|l| l.record.state == SandboxState::Retired) {
        let record = &live.record;
        let deadline = record.deadline.expect("a deadline");
        assert!(record.retired_at.is_some_and(|at| at < deadline), "retired before its deadline");
    }
}

#[test]
fn without_a_spare_slot_a_standby_is_retired_before_its_deadline_then_replaced() {
    let mut config = lifecycle(1, 1);
    config.pool_policy.standby_ttl = Duration::from_secs(100);
    let mut sim = Sim::new(config);
    let step = sim.world.tick();
    sim.observe(&step);
    sim.settle();
    for _ in 0..150 {
        sim.advance(SECOND);
    }
    let reasons: BTreeSet<String> =
        sim.world.machine.sandboxes.values().filter_map(|live| live.record.retire_reason.clone()).collect();
    assert_eq!(reasons, BTreeSet::from(["standby TTL: retired before its deadline".to_owned()]));
}

// ---- threads -----------------------------------------------------------------------

#[test]
fn tier_2_a_follow_up_in_the_warm_window_takes_the_running_sandbox_at_once() {
    let mut world = World::with(lifecycle(0, 8));
    let (first, step) = turn(&mut world, "t1");
    let assignment = deliver(&mut world, &step);
    let sandbox_id = world.run(&first).current().expect("bound").sandbox_id.clone();
    let old_token = launches(&step).remove(0).token;
    let step = finish(&mut world, &assignment);
    assert_eq!(world.sandbox(&sandbox_id).state, SandboxState::Parked);
    assert_eq!(park_mode(&world, &sandbox_id), Some(ParkMode::Running));
    assert!(retires(&step).is_empty(), "kept, not deleted");
    let pointer = world.machine.thread("t1").expect("a pointer").clone();
    assert_eq!((pointer.sandbox_id.as_deref(), pointer.holder), (Some(sandbox_id.as_str()), None));
    // The turn's agent exits: a fresh one is launched in the same sandbox
    // with a new standby credential.
    let step = exited(&mut world, &sandbox_id);
    let (resumed, token, _) = resumes(&step).remove(0);
    assert_eq!(resumed, sandbox_id);
    assert_ne!(token, old_token);
    let conn = ready_conn(&mut world, &token);
    world.advance(30 * SECOND);
    world.heartbeat(conn, AgentState::Ready);
    let (second, step) = turn(&mut world, "t1");
    let run = world.run(&second);
    assert_eq!(run.state, RunState::Committed, "bound in the submit's own step");
    assert_eq!(run.path(), Some(RunPath::ParkedRunning));
    assert_eq!(run.current().expect("bound").sandbox_id, sandbox_id);
    assert_eq!(assignments(&step).len(), 1);
    assert!(resumes(&step).is_empty() && stops(&step).is_empty(), "no stop, no start");
}

#[test]
fn tier_1_after_the_window_the_sandbox_is_stopped_and_a_follow_up_is_bound_only_once_it_is_ready() {
    let mut world = World::with(lifecycle(0, 8));
    let sandbox_id = parked_running(&mut world, "t1");
    let parked_token = world.sandbox(&sandbox_id).standby_credential_id.clone();
    world.advance(MINUTE.as_millis() as i64);
    let step = world.tick();
    assert_eq!(stops(&step), std::slice::from_ref(&sandbox_id), "the warm idle window ended");
    assert_eq!(park_mode(&world, &sandbox_id), Some(ParkMode::Stopped));
    assert_eq!(world.machine.credentials[&parked_token].state, CredentialState::Revoked);
    exited(&mut world, &sandbox_id);
    assert!(!world.machine.sandbox_views(world.now).iter().any(|v| v.record.id == sandbox_id && v.running));
    world.advance(3_600 * SECOND);
    let (second, step) = turn(&mut world, "t1");
    assert_eq!(world.run(&second).state, RunState::Resuming);
    assert!(assignments(&step).is_empty(), "not told before its agent is ready");
    assert!(world.run(&second).attempts.is_empty(), "not bound either");
    let (resumed, token, _) = resumes(&step).remove(0);
    assert_eq!(resumed, sandbox_id);
    let (_, conn, step) = world.connect(&token);
    assert!(assignments(&step).is_empty());
    world.heartbeat(conn, AgentState::Preparing);
    assert_eq!(world.run(&second).state, RunState::Resuming);
    world.advance(2 * SECOND);
    let step = world.heartbeat(conn, AgentState::Ready);
    let run = world.run(&second);
    assert_eq!(run.path(), Some(RunPath::ParkedStopped));
    assert_eq!(run.current().expect("bound").sandbox_id, sandbox_id);
    assert_eq!(assignments(&step).len(), 1, "told once ready");
    let resume = run.resume.expect("recorded");
    assert_eq!((resume.from, resume.fallback), (ParkMode::Stopped, None));
    assert_eq!(resume.ready_at.map(|at| at.since(resume.began_at)), Some(2_000));
}

#[test]
fn a_follow_up_while_the_fresh_agent_starts_waits_for_it() {
    let mut world = World::with(lifecycle(0, 8));
    let (_, step) = turn(&mut world, "t1");
    let assignment = deliver(&mut world, &step);
    let sandbox_id = world.run(&assignment.execution_id).current().expect("bound").sandbox_id.clone();
    finish(&mut world, &assignment);
    // The turn's agent has not exited yet.
    let (second, step) = turn(&mut world, "t1");
    assert_eq!(world.run(&second).state, RunState::Resuming);
    assert!(resumes(&step).is_empty(), "one agent at a time: after the old one exits");
    let step = exited(&mut world, &sandbox_id);
    let (_, token, _) = resumes(&step).remove(0);
    let step = ready(&mut world, &token);
    assert_eq!(assignments(&step).len(), 1);
    assert_eq!(world.run(&second).path(), Some(RunPath::ParkedRunning));
}

#[test]
fn a_resume_that_fails_falls_back_to_a_fresh_sandbox_and_records_why() {
    for failure in ["deleted", "timeout", "agent exit"] {
        let mut world = World::with(lifecycle(0, 8));
        let sandbox_id = parked_running(&mut world, "t1");
        world.advance(MINUTE.as_millis() as i64);
        world.tick();
        exited(&mut world, &sandbox_id);
        let (second, step) = turn(&mut world, "t1");
        let (_, token, _) = resumes(&step).remove(0);
        let step = match failure {
            "deleted" => {
                let step = world.machine.resume_failed(world.now, &sandbox_id, "the sandbox no longer exists", true);
                world.keep(step)
            }
            "timeout" => {
                world.connect(&token);
                world.advance(31 * SECOND);
                world.tick()
            }
            _ => {
                world.connect(&token);
                exited(&mut world, &sandbox_id)
            }
        };
        let run = world.run(&second);
        let fallback = run.resume.as_ref().and_then(|r| r.fallback.clone()).expect("the reason is recorded");
        let expected = match failure {
            "deleted" => "no longer exists",
            "timeout" => "not ready within 30s",
            _ => "ended before it was ready",
        };
        assert!(fallback.contains(expected), "{failure}: {fallback}");
        assert_eq!(run.path(), Some(RunPath::Cold), "{failure}: the run goes on");
        assert_eq!(world.sandbox(&sandbox_id).state, SandboxState::Retired);
        let new_sandbox = run.current().expect("bound").sandbox_id.clone();
        assert_eq!(world.machine.thread("t1").and_then(|t| t.sandbox_id.clone()), Some(new_sandbox));
        assert_eq!(launches(&step).len(), 1, "{failure}: a cold sandbox");
        assert_eq!(world.machine.authenticate(token.expose()), Err(Refusal::Unauthorized));
    }
}

#[test]
fn a_changed_workspace_is_not_resumed() {
    let mut world = World::with(lifecycle(0, 8));
    let sandbox_id = parked_running(&mut world, "t1");
    let mut changed = run("turn");
    changed.workspace = Some(Workspace {
        repos: vec![Repo { url: "file:///other".into(), path: "app".into(), git_ref: None, expected_sha: None }],
        setup: Vec::new(),
    });
    let (step, second) = world.machine.submit_turn(world.now, changed, request(), Some("t1".into()));
    let run = world.run(&second);
    let fallback = run.resume.as_ref().and_then(|r| r.fallback.clone()).expect("recorded");
    assert!(fallback.contains("fingerprint"), "{fallback}");
    assert_eq!(run.path(), Some(RunPath::Cold));
    assert!(retires(&step).contains(&sandbox_id));
}

#[test]
fn two_turns_of_a_thread_never_hold_its_sandbox_at_once() {
    let mut world = World::with(lifecycle(0, 8));
    let (first, step) = turn(&mut world, "t1");
    let assignment = deliver(&mut world, &step);
    let sandbox_id = world.run(&first).current().expect("bound").sandbox_id.clone();
    let (second, step) = turn(&mut world, "t1");
    let waiting = world.run(&second);
    assert_eq!(waiting.state, RunState::Waiting);
    assert!(waiting.wait.as_ref().is_some_and(|w| w.reason.contains(&first) && !w.for_slot));
    assert!(launches(&step).is_empty());
    // Other threads are not held up.
    let (other, _) = turn(&mut world, "t2");
    assert_eq!(world.run(&other).state, RunState::Committed);
    finish(&mut world, &assignment);
    let step = exited(&mut world, &sandbox_id);
    let (_, token, _) = resumes(&step).remove(0);
    ready(&mut world, &token);
    let run = world.run(&second);
    assert_eq!(run.path(), Some(RunPath::ParkedRunning));
    assert_eq!(run.current().expect("bound").sandbox_id, sandbox_id);
    assert_eq!(world.machine.thread("t1").and_then(|t| t.holder.clone()), Some(second));
}

#[test]
fn a_stale_pointer_write_is_rejected() {
    let mut world = World::with(lifecycle(0, 8));
    let (first, step) = turn(&mut world, "t1");
    let assignment = deliver(&mut world, &step);
    let sandbox_id = world.run(&first).current().expect("bound").sandbox_id.clone();
    let held = world.run(&first).thread_generation.expect("the turn holds the pointer");
    // Another writer (a second server on the store) moves the pointer on.
    let mut step = Step::default();
    world
        .machine
        .write_thread(world.now, &mut step, "t1", held, |thread| {
            thread.sandbox_id = Some("sbx_elsewhere".into());
            thread.holder = Some("exe_elsewhere".into());
        })
        .expect("the current generation is accepted");
    world.keep(step);
    // A write that read the old generation is refused...
    let mut step = Step::default();
    let stale = world.machine.write_thread(world.now, &mut step, "t1", held, |thread| thread.holder = None);
    assert_eq!(stale, Err(StalePointer { thread_id: "t1".into(), expected: held, found: held + 1 }));
    assert!(step.writes.is_empty());
    // ...and so is the late turn's park: its sandbox is released instead.
    let step = finish(&mut world, &assignment);
    assert_eq!(retires(&step), std::slice::from_ref(&sandbox_id));
    assert!(parks(&step).is_empty());
    assert!(world.sandbox(&sandbox_id).retire_reason.is_some_and(|r| r.contains("generation")));
    let pointer = world.machine.thread("t1").expect("a pointer");
    assert_eq!(pointer.sandbox_id.as_deref(), Some("sbx_elsewhere"), "the newer pointer stands");
    assert_eq!(pointer.generation, held + 1);
}

#[test]
fn at_the_cap_the_oldest_parked_running_sandbox_makes_room_for_a_waiting_run() {
    for park_stopped in [true, false] {
        let mut config = lifecycle(0, 2);
        config.pool_policy.park_stopped = park_stopped;
        let mut world = World::with(config);
        let oldest = parked_running(&mut world, "a");
        world.advance(SECOND);
        let newer = parked_running(&mut world, "b");
        let (waiting, step) = world.submit(run("c"));
        assert_eq!(world.run(&waiting).state, RunState::Waiting);
        if park_stopped {
            assert_eq!(stops(&step), std::slice::from_ref(&oldest));
            assert_eq!(park_mode(&world, &oldest), Some(ParkMode::Stopped));
        } else {
            assert_eq!(retires(&step), std::slice::from_ref(&oldest), "released");
        }
        assert_eq!(park_mode(&world, &newer), Some(ParkMode::Running));
        let step = exited(&mut world, &oldest);
        assert_eq!(launches(&step).len(), 1);
        assert_eq!(world.run(&waiting).path(), Some(RunPath::Cold));
    }
}

#[test]
fn a_kept_sandbox_gets_an_auto_stop_above_the_warm_window() {
    for (window_s, configured, expected) in [(900, 15, 20), (125, 1, 8), (300, 0, 0), (300, 60, 60)] {
        let mut config = lifecycle(0, 8);
        config.pool_policy.warm_idle = Duration::from_secs(window_s);
        config.pool_policy.auto_stop = AutoStop { minutes: configured, minute: MINUTE };
        let mut world = World::with(config);
        let (_, step) = turn(&mut world, "t1");
        assert!(
            step.effects.iter().any(|e| matches!(e, Effect::Launch { auto_stop, .. } if *auto_stop == configured)),
            "a cold sandbox is created with the configured auto-stop"
        );
        let assignment = deliver(&mut world, &step);
        let sandbox_id = world.run(&assignment.execution_id).current().expect("bound").sandbox_id.clone();
        let step = finish(&mut world, &assignment);
        assert_eq!(parks(&step), [(sandbox_id.clone(), expected)], "window {window_s} s, configured {configured}");
        let step = exited(&mut world, &sandbox_id);
        assert_eq!(resumes(&step)[0].2, expected, "and the resume keeps it");
    }
}

#[test]
fn a_restart_brings_parked_sandboxes_back_stopped_and_resumes_again() {
    let mut world = World::with(lifecycle(0, 8));
    let sandbox_id = parked_running(&mut world, "t1");
    let (second, _) = {
        world.advance(MINUTE.as_millis() as i64);
        world.tick();
        exited(&mut world, &sandbox_id);
        turn(&mut world, "t1")
    };
    assert_eq!(world.run(&second).state, RunState::Resuming);
    let (mut machine, step) =
        Dispatch::restore(lifecycle(0, 8), Box::new(CountingMint::starting_at(10_000)), world.snapshot(), world.now);
    // The turn claims its sandbox again at once; it is started once the
    // provider said what became of it.
    assert_eq!(machine.sandbox(&sandbox_id).map(|r| r.state), Some(SandboxState::Resuming));
    assert_eq!(machine.run(&second).map(|r| r.state), Some(RunState::Resuming));
    assert!(step.effects.iter().any(|e| matches!(e, Effect::Probe { sandbox_id: id } if *id == sandbox_id)));
    assert!(resumes(&step).is_empty(), "not before the probe");
    let step = machine.probed(world.now, &sandbox_id, Found::Stopped);
    let resumed: Vec<String> = resumes(&step).into_iter().map(|(id, ..)| id).collect();
    assert_eq!(resumed, std::slice::from_ref(&sandbox_id), "the run resumes its thread's sandbox again");
    assert_eq!(machine.run(&second).map(|r| r.state), Some(RunState::Resuming));
    let counts: HashMap<SandboxState, usize> =
        machine.sandbox_views(world.now).iter().fold(HashMap::new(), |mut m, v| {
            *m.entry(v.record.state).or_default() += 1;
            m
        });
    assert_eq!(counts.get(&SandboxState::Resuming), Some(&1));
}
