//! The pool policy: standbys kept ready, the running cap, the standby TTL.

use std::collections::{BTreeSet, VecDeque};

use super::*;
use crate::model::Wait;

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
    Run(Box<Assignment>),
    Exit(String),
}

impl Sim {
    fn new(config: RulesConfig) -> Self {
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

    /// A sim of `config` whose pool is filled and ready.
    fn filled(config: RulesConfig) -> Self {
        let mut sim = Self::new(config);
        let step = sim.world.tick();
        sim.observe(&step);
        sim.settle();
        sim
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
                        let event = Event::new(format!("{run_id}-{n}"), kind);
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
fn the_pool_is_filled_with_standbys_that_have_their_own_credentials() {
    let mut world = World::new(2);
    let step = world.tick();
    let launched = launches(&step);
    assert_eq!(launched.len(), 2);
    assert!(step.effects.iter().all(|e| matches!(e, Effect::Launch { provision: Provision::Create, .. })));
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
    assert_eq!(world.machine.authenticate(first.token.expose()), Err(AdmissionRefusal::Gone));
    world.advance(SECOND + 1);
    let second = launches(&world.tick()).remove(0);
    let (_, conn, _) = world.connect(&second.token);
    world.heartbeat(conn, AgentState::Ready);
    // A standby that was ready and then exits is replaced at once.
    let step = world.machine.sandbox_exited(world.now, &second.sandbox_id, Some(0));
    assert_eq!(launches(&step).len(), 1);
}

#[test]
fn a_burst_never_exceeds_the_running_cap_and_every_run_waits_in_order_and_completes() {
    let mut sim = Sim::filled(policy(2, 4));
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
    let mut world = World::with(policy(2, 2));
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
    let mut config = policy(1, 1);
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

#[test]
fn ttl_replacement_keeps_min_ready_standbys_ready() {
    let mut config = policy(2, 3);
    config.pool_policy.standby_ttl = Duration::from_secs(100);
    let mut sim = Sim::filled(config);
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
    let mut config = policy(1, 1);
    config.pool_policy.standby_ttl = Duration::from_secs(100);
    let mut sim = Sim::filled(config);
    for _ in 0..150 {
        sim.advance(SECOND);
    }
    let reasons: BTreeSet<String> =
        sim.world.machine.sandboxes.values().filter_map(|live| live.record.retire_reason.clone()).collect();
    assert_eq!(reasons, BTreeSet::from(["standby TTL: retired before its deadline".to_owned()]));
}

#[test]
fn a_large_pool_fills_a_bounded_batch_per_step() {
    let mut world = World::new(super::super::pool::TOP_UP_BATCH + 10);
    assert_eq!(launches(&world.tick()).len(), super::super::pool::TOP_UP_BATCH, "one batch in the first step");
    assert_eq!(launches(&world.tick()).len(), 10, "the rest in the next");
    assert!(launches(&world.tick()).is_empty());
}

#[test]
fn at_most_max_preparing_standbys_prepare_at_once() {
    let mut config = config(5);
    config.pool_policy.max_preparing = 2;
    let mut world = World::with(config);
    let first = launches(&world.tick());
    assert_eq!(first.len(), 2, "two prepare, three wait");
    assert!(launches(&world.tick()).is_empty(), "none more while both prepare");

    let (_, conn, _) = world.connect(&first[0].token);
    world.heartbeat(conn, AgentState::Ready);
    assert_eq!(launches(&world.tick()).len(), 1, "one ready: one more prepares");
    let (_, conn, _) = world.connect(&first[1].token);
    world.heartbeat(conn, AgentState::Ready);
    assert_eq!(launches(&world.tick()).len(), 1);
}
