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
