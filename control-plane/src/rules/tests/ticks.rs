//! Time passing: silent standbys and silent unconfirmed sandboxes.

use super::*;

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
    assert_eq!(world.machine.authenticate(standby.token.expose()), Err(AdmissionRefusal::Gone));
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
    let Warm { run_id, assignment, .. } = world.warm_run();
    world.connect(&assignment.run_credential);
    world.advance(60 * SECOND);
    world.tick();
    assert_eq!(world.run(&run_id).state, RunState::Confirmed);
}

#[test]
fn a_running_run_unheard_past_the_run_silence_is_failed_and_its_sandbox_written_off() {
    let mut world = World::new(1);
    let Warm { standby, run_id, assignment, .. } = world.warm_run();
    let (_, run_conn, _) = world.connect(&assignment.run_credential);
    world.event(&run_id, "started", EventKind::Started);
    world.heartbeat(run_conn, AgentState::Running);
    world.machine.disconnected(run_conn);
    world.advance(120 * SECOND);
    world.tick();
    assert_eq!(world.run(&run_id).state, RunState::Running, "within the bound: the agent may be reconnecting");
    world.advance(1);
    let step = world.tick();
    assert_eq!(world.run(&run_id).state, RunState::Failed);
    assert!(
        world.run(&run_id).error.as_deref().is_some_and(|e| e.contains("run silence")),
        "{:?}",
        world.run(&run_id).error
    );
    assert!(retires(&step).contains(&standby.sandbox_id), "its sandbox is stopped and deleted");
    assert_eq!(world.run(&run_id).attempts.len(), 1, "never run again");
}

/// After a restart no provider watches an adopted sandbox's agent: a
/// confirmed run whose agent died while the server was down is failed
/// once the bound has passed since the restart, not left running.
#[test]
fn after_a_restart_a_confirmed_run_whose_agent_never_returns_is_failed() {
    let mut world = World::new(1);
    let Warm { run_id, assignment, .. } = world.warm_run();
    world.connect(&assignment.run_credential);
    assert_eq!(world.run(&run_id).state, RunState::Confirmed);
    world.advance(500 * SECOND);
    let (mut machine, _) =
        Rules::restore(config(1), Box::new(CountingMint::starting_at(1000)), world.snapshot(), world.now);
    let restarted = world.now;
    let sandbox_id = world.run(&run_id).current().map(|a| a.sandbox_id.clone()).expect("an attempt");
    machine.probed(restarted, &sandbox_id, Found::Running);
    machine.tick(restarted.plus(Duration::from_secs(120)));
    assert_eq!(machine.run(&run_id).map(|r| r.state), Some(RunState::Confirmed));
    machine.tick(restarted.plus(Duration::from_secs(121)));
    assert_eq!(machine.run(&run_id).map(|r| r.state), Some(RunState::Failed));
}

/// A replica holding agents' sockets gathers their routine heartbeats
/// (`cluster::link`): gathered, they keep a standby alive as forwarded
/// ones do, and write and tell nothing.
#[test]
fn gathered_heartbeats_keep_a_standby_alive_and_write_nothing() {
    let mut world = World::new(1);
    let (standby, conn) = world.ready_pool().remove(0);
    world.advance(3 * SECOND);
    let step = world.machine.handle(world.now, Input::Heard { conns: vec![conn, 999] });
    assert!(step.writes.is_empty() && step.effects.is_empty(), "{step:?}");
    world.advance(3 * SECOND);
    assert!(world.tick().is_empty(), "heard three seconds ago: not silent");
    world.advance(1);
    assert_eq!(retires(&world.tick()), [standby.sandbox_id], "silent once the gathered heartbeats stop");
}
