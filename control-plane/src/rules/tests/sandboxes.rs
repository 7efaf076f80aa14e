//! Sandboxes as the provider reports them: exits, losses, probes after a restart, draining.

use super::*;

#[test]
fn a_committed_standby_that_exits_before_confirming_is_written_off_and_the_run_requeued_cold() {
    let mut world = World::new(2);
    let Warm { standby, run_id, assignment, .. } = world.warm_run();
    let first_credential = world.run(&run_id).current().map(|a| a.credential_id.clone()).expect("attempt");
    let step = world.machine.sandbox_exited(world.now, &standby.sandbox_id, None);
    let step = world.keep(step);
    assert_eq!(position(&step, revokes(&first_credential)), 0);
    // Both credentials are now refused with 401: the sandbox can neither
    // start the run nor come back as a standby.
    assert_eq!(world.machine.authenticate(assignment.run_credential.expose()), Err(AdmissionRefusal::Unauthorized));
    assert_eq!(world.machine.authenticate(standby.token.expose()), Err(AdmissionRefusal::Unauthorized));
    let record = world.run(&run_id);
    assert_eq!(record.attempts.len(), 2);
    assert_eq!(record.attempts[0].outcome, Some(AttemptOutcome::Requeued));
    assert_eq!(record.attempts[1].path, RunPath::Cold, "one pre-warmed attempt only, though a standby is ready");
    assert_eq!(record.state, RunState::Committed);
    assert_eq!(launches(&step).len(), 2, "the cold sandbox and the pool's replacement");
    assert_eq!(world.machine.metrics(world.now).lost, LostRuns::default(), "requeued, not lost");
}

#[test]
fn a_sandbox_that_dies_after_confirmation_fails_its_run_rather_than_run_it_twice() {
    let mut world = World::new(1);
    let Warm { standby, run_id, assignment, .. } = world.warm_run();
    world.connect(&assignment.run_credential);
    assert_eq!(world.run(&run_id).state, RunState::Confirmed);
    // It may have started the run; `started` is still on its way.
    let step = world.machine.sandbox_exited(world.now, &standby.sandbox_id, None);
    let record = world.run(&run_id);
    assert_eq!(record.state, RunState::Failed);
    assert_eq!(record.attempts.len(), 1, "not sent to another sandbox");
    assert!(record.error.as_deref().is_some_and(|e| e.contains("not run again")), "{:?}", record.error);
    assert_eq!(world.machine.authenticate(assignment.run_credential.expose()), Err(AdmissionRefusal::Unauthorized));
    assert!(
        launches(&step).iter().all(|l| world.sandbox(&l.sandbox_id).kind == SandboxKind::Warm),
        "no cold sandbox for it"
    );
    assert_eq!(world.machine.metrics(world.now).lost, LostRuns { before_start: 1, after_start: 0 }, "counted lost");
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
    assert_eq!(world.machine.metrics(world.now).lost, LostRuns { before_start: 0, after_start: 1 }, "counted lost");
}

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
    let (mut machine, step) = Rules::restore(config(1), Box::new(CountingMint::starting_at(1000)), snapshot, world.now);
    assert!(machine.run(&done).is_none(), "a finished run is not loaded");
    assert_eq!(machine.metrics(world.now).runs.get(&(RunState::Exited, Some(RunPath::Warm))), Some(&1), "but counted");
    let probes: Vec<&Effect> = step.effects.iter().filter(|e| matches!(e, Effect::Probe { .. })).collect();
    assert_eq!(probes.len(), 1, "only the live standby is probed: {probes:?}");
    assert!(launches(&step).is_empty(), "the live standby still counts for the pool");
    let _ = standby;
    let step = machine.probed(world.now, &replacement.record.id, Found::NoAgent);
    let relaunch = launches(&step).remove(0);
    assert_eq!(relaunch.sandbox_id, replacement.record.id);
    assert!(step.effects.iter().any(|e| matches!(e, Effect::Launch { provision: Provision::Start, .. })));
    assert!(matches!(machine.authenticate(relaunch.token.expose()), Ok(Admission::Standby { .. })));
    // Events survive: a retried event from before the restart is a duplicate.
    let again = machine.event(world.now, &done, 1, Event::new("x", EventKind::Exited { code: 0 }));
    assert!(again.is_empty());
}

#[test]
fn a_restart_writes_off_a_committed_sandbox_that_stopped() {
    let mut world = World::new(1);
    let (standby, _) = world.ready_pool().remove(0);
    let (run_id, _) = world.submit(run("a"));
    let (mut machine, _) =
        Rules::restore(config(1), Box::new(CountingMint::starting_at(1000)), world.snapshot(), world.now);
    let step = machine.probed(world.now, &standby.sandbox_id, Found::NoAgent);
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
        Rules::restore(config(0), Box::new(CountingMint::starting_at(1000)), world.snapshot(), world.now);
    machine.probed(world.now, &cold.sandbox_id, Found::Running);
    let (admission, _) = machine.claim_socket(world.now, 1, cold.token.expose()).expect("admitted");
    let step = machine.connected(world.now, 1, (admission.credential_id(), &cold.token), None);
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
