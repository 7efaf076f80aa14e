//! A user's inputs: cancels before and after the start, and which runs cannot be cancelled.

use super::*;

#[test]
fn cancel_before_confirmation_withdraws_first_and_retires_the_sandbox() {
    let mut world = World::new(1);
    let Warm { standby, conn, run_id, assignment } = world.warm_run();
    let credential_id = world.run(&run_id).current().map(|a| a.credential_id.clone()).expect("an attempt");
    let (step, state) = world.machine.cancel(world.now, &run_id).expect("cancelled");
    assert_eq!(state, RunState::Cancelled);
    let finishing =
        |w: &Write| matches!(w, Write::Credential(c) if c.id == credential_id && c.state == CredentialState::Finishing);
    assert_eq!(position(&step, finishing), 0, "the run credential is withdrawn first");
    assert!(matches!(sends(&step, conn).as_slice(), [ServerMessage::Cancel(c)] if c.execution_id == run_id));
    assert_eq!(retires(&step), std::slice::from_ref(&standby.sandbox_id));
    // Amendment 8: only the run's events and log, until the agent is done.
    assert_eq!(world.machine.authenticate(assignment.run_credential.expose()), Err(AdmissionRefusal::Ended));
    assert!(world.machine.check(assignment.run_credential.expose(), Call::Report).is_ok());
    assert_eq!(world.machine.check(assignment.run_credential.expose(), Call::Socket), Err(AdmissionRefusal::Ended));
    assert_eq!(world.machine.authenticate(standby.token.expose()), Err(AdmissionRefusal::Gone));
    let record = world.run(&run_id);
    assert_eq!(record.current().and_then(|a| a.outcome), Some(AttemptOutcome::Cancelled));
    assert_eq!(world.sandbox(&standby.sandbox_id).state, SandboxState::Retired);
    assert_eq!(launches(&step).len(), 1, "the pool is refilled");
}

#[test]
fn cancel_of_a_running_run_asks_the_agent_and_waits_for_its_report() {
    let mut world = World::new(1);
    let Warm { run_id, assignment, .. } = world.warm_run();
    let (_, run_conn, _) = world.connect(&assignment.run_credential);
    world.event(&run_id, "e1", EventKind::Started);
    assert_eq!(world.run(&run_id).state, RunState::Running);
    let (step, state) = world.machine.cancel(world.now, &run_id).expect("cancelling");
    assert_eq!(state, RunState::Cancelling);
    assert!(matches!(sends(&step, run_conn).as_slice(), [ServerMessage::Cancel(_)]));
    let token = assignment.run_credential.expose();
    assert!(world.machine.check(token, Call::Report).is_ok(), "it can still report");
    assert_eq!(world.machine.authenticate(token), Err(AdmissionRefusal::Ended), "and do nothing else (amendment 8)");
    let step = world.event(&run_id, "e2", EventKind::Cancelled);
    assert_eq!(world.run(&run_id).state, RunState::Cancelled);
    assert_eq!(world.machine.check(token, Call::Report), Err(AdmissionRefusal::Ended), "its report was the last");
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
fn the_assignment_lists_the_attachments_inline() {
    let mut world = World::new(1);
    world.ready_pool();
    let mut with_files = request();
    with_files.attachments.push(crate::model::StoredAttachment {
        name: "spec.md".into(),
        content_base64: "YWJj".into(),
        sha256: "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad".into(),
    });
    let (step, run_id) = world.machine.submit(world.now, run("a"), with_files);
    let step = world.keep(step);
    let inline = assignments(&step).remove(0).1.run.attachments.expect("listed inline (amendment 5)");
    assert_eq!(inline.len(), 1);
    assert_eq!(inline[0].name, "spec.md");
    assert_eq!(inline[0].url, standby_protocol::paths::attachment(&run_id, "spec.md"));
    assert_eq!(inline[0].sha256, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    // No attachments: an empty list, so the agent makes no call at all.
    let (none, _) = world.submit(run("b"));
    assert_eq!(world.run(&none).run.attachments, Some(Vec::new()));
}
