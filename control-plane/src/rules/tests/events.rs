//! Lifecycle events: deduplication, `install_failed` requeues and final failures.

use super::*;

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

/// Contract 1.1 note 10: the final event's `log_lost` is kept on the run,
/// 0 when it has none; a run that ends without that event keeps nothing.
#[test]
fn the_final_event_s_log_lost_is_kept_on_the_run() {
    let mut world = World::new(3);
    world.ready_pool();
    let (lost, _) = world.submit(run("a"));
    world.event(&lost, "s", EventKind::Started);
    let step =
        world.machine.event(world.now, &lost, 1, Event::new("x", EventKind::Exited { code: 0 }).with_log_lost(42));
    let written = step.writes.iter().rev().find_map(|w| match w {
        Write::Run(run) if run.id == lost => Some(run.log_lost),
        _ => None,
    });
    assert_eq!(written, Some(Some(42)), "written with the run's end");
    world.keep(step);
    assert_eq!(world.run(&lost).log_lost, Some(42));

    let (whole, _) = world.submit(run("b"));
    world.event(&whole, "s", EventKind::Started);
    assert_eq!(world.run(&whole).log_lost, None, "not known before the end");
    world.event(&whole, "x", EventKind::Exited { code: 0 });
    assert_eq!(world.run(&whole).log_lost, Some(0));

    let (failed, _) = world.submit(run("c"));
    world.event(&failed, "f", EventKind::install_failed(Stage::Secrets, Cause::InvalidRun, "no"));
    assert_eq!(world.run(&failed).log_lost, None, "no final report of a log");
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
fn a_requeueable_install_failure_requeues_to_a_cold_sandbox_once_warm() {
    let mut world = World::new(2);
    let Warm { standby, run_id, assignment, .. } = world.warm_run();
    world.connect(&assignment.run_credential);
    let failure = EventKind::install_failed(Stage::SamePreparation, Cause::FingerprintMismatch, "fingerprint mismatch");
    let step = world.event(&run_id, "f1", failure);
    let revoked = position(&step, revokes(&world.run(&run_id).attempts[0].credential_id));
    let requeued = position(&step, |w| matches!(w, Write::Run(r) if r.attempts.len() == 2));
    assert!(revoked < requeued, "fenced before the next attempt");
    assert!(retires(&step).contains(&standby.sandbox_id));
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
