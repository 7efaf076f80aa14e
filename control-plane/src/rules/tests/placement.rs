//! Binding queued runs: warm candidates, commit before tell, cold sandboxes.

use super::*;

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
