//! The credential lifecycle and one socket per credential
//! ([`super::super::admission`]).

use super::*;

const SILENCE: i64 = 3 * SECOND;

fn retires_credential(credential_id: &str) -> impl Fn(&Write) -> bool + '_ {
    move |write| matches!(write, Write::Credential(c) if c.id == credential_id && c.state == CredentialState::Retired)
}

fn ends_run(run_id: &str, state: RunState) -> impl Fn(&Write) -> bool + '_ {
    move |write| matches!(write, Write::Run(r) if r.id == run_id && r.state == state)
}

/// A warm run whose run credential connected and that started: the run,
/// its assignment and the run connection.
fn running(world: &mut World) -> (String, Assignment, ConnId) {
    let Warm { run_id, assignment, .. } = world.warm_run();
    let (_, run_conn, _) = world.connect(&assignment.run_credential);
    world.event(&run_id, "started", EventKind::Started);
    (run_id, assignment, run_conn)
}

fn refused_everywhere(machine: &Rules, token: &Secret) {
    for call in [Call::Socket, Call::Fetch, Call::Report] {
        assert_eq!(machine.check(token.expose(), call), Err(AdmissionRefusal::Ended), "{call:?}");
    }
}

#[test]
fn a_run_credential_is_retired_in_the_step_that_records_its_run_exited() {
    let mut world = World::new(1);
    let (run_id, assignment, run_conn) = running(&mut world);
    let credential_id = world.run(&run_id).current().map(|a| a.credential_id.clone()).expect("an attempt");
    let step = world.event(&run_id, "exited", EventKind::Exited { code: 0 });
    // One step, so one store transaction: the terminal state and the
    // withdrawal are durable together.
    position(&step, ends_run(&run_id, RunState::Exited));
    position(&step, retires_credential(&credential_id));
    assert!(closes(&step).contains(&run_conn), "its socket is closed");
    refused_everywhere(&world.machine, &assignment.run_credential);
    // A heartbeat on the closing socket no longer speaks for the sandbox.
    assert!(world.heartbeat(run_conn, AgentState::Ready).is_empty());
    // After a restart too.
    let (machine, _) =
        Rules::restore(config(1), Box::new(CountingMint::starting_at(1000)), world.snapshot(), world.now);
    refused_everywhere(&machine, &assignment.run_credential);
}

#[test]
fn a_run_credential_is_retired_when_its_run_fails() {
    let mut world = World::new(1);
    let (run_id, assignment, _) = running(&mut world);
    let sandbox_id = world.run(&run_id).current().map(|a| a.sandbox_id.clone()).expect("an attempt");
    world.machine.sandbox_exited(world.now, &sandbox_id, Some(1));
    assert_eq!(world.run(&run_id).state, RunState::Failed);
    refused_everywhere(&world.machine, &assignment.run_credential);
}

#[test]
fn a_restart_retires_the_credentials_an_older_server_left_active() {
    let mut world = World::new(1);
    let (run_id, assignment, _) = running(&mut world);
    world.event(&run_id, "exited", EventKind::Exited { code: 0 });
    // What a store written before this rule holds: the run exited, its
    // credential still active.
    let mut snapshot = world.snapshot();
    for credential in &mut snapshot.credentials {
        if credential.kind == CredentialKind::Run {
            credential.state = CredentialState::Active;
        }
    }
    let (machine, step) = Rules::restore(config(1), Box::new(CountingMint::starting_at(1000)), snapshot, world.now);
    let credential_id = world.run(&run_id).current().map(|a| a.credential_id.clone()).expect("an attempt");
    position(&step, retires_credential(&credential_id));
    refused_everywhere(&machine, &assignment.run_credential);
}

/// Amendment 8: after a cancel the run credential may post the run's events
/// and log until the agent exits; every other call is refused.
#[test]
fn after_a_cancel_the_run_credential_reports_until_the_agent_is_done() {
    for ending in ["report", "exit", "bound"] {
        let mut world = World::new(1);
        let (standby, _) = world.ready_pool().remove(0);
        let (run_id, step) = world.submit(run("a"));
        let token = assignments(&step).remove(0).1.run_credential;
        world.machine.cancel(world.now, &run_id).expect("cancelled");
        assert_eq!(world.run(&run_id).state, RunState::Cancelled);
        assert!(world.machine.check(token.expose(), Call::Report).is_ok(), "{ending}");
        assert_eq!(world.machine.check(token.expose(), Call::Fetch), Err(AdmissionRefusal::Ended));
        assert_eq!(world.machine.check(token.expose(), Call::Socket), Err(AdmissionRefusal::Ended));
        match ending {
            "report" => {
                // The agent's `cancelled` is accepted (recorded) and is its last word.
                let step = world.event(&run_id, "cancelled", EventKind::Cancelled);
                assert!(step.writes.iter().any(|w| matches!(w, Write::Event(_))), "the event is stored");
            }
            "exit" => {
                world.machine.sandbox_exited(world.now, &standby.sandbox_id, Some(0));
            }
            _ => {
                // linger (5 s) plus the silence limit (3 s) after the cancel.
                world.advance(5 * SECOND + SILENCE);
                assert!(world.machine.check(token.expose(), Call::Report).is_ok(), "not before the bound");
                world.advance(1);
                world.tick();
            }
        }
        refused_everywhere(&world.machine, &token);
        assert_eq!(world.run(&run_id).state, RunState::Cancelled, "{ending}");
    }
}

#[test]
fn a_cancel_grace_survives_a_restart_with_a_fresh_bound() {
    let mut world = World::new(1);
    world.ready_pool();
    let (run_id, step) = world.submit(run("a"));
    let token = assignments(&step).remove(0).1.run_credential;
    let (step, _) = world.machine.cancel(world.now, &run_id).expect("cancelled");
    world.keep(step);
    let (mut machine, _) =
        Rules::restore(config(1), Box::new(CountingMint::starting_at(1000)), world.snapshot(), world.now);
    assert!(machine.check(token.expose(), Call::Report).is_ok());
    assert_eq!(machine.check(token.expose(), Call::Fetch), Err(AdmissionRefusal::Ended));
    machine.tick(world.now.plus(Duration::from_millis((5 * SECOND + SILENCE + 1) as u64)));
    refused_everywhere(&machine, &token);
}

// ---- one socket per credential ---------------------------------------------------------

#[test]
fn a_second_socket_on_a_live_standby_credential_is_refused_and_counted() {
    let mut world = World::new(1);
    let (standby, first) = world.ready_pool().remove(0);
    world.advance(2 * SECOND);
    world.heartbeat(first, AgentState::Ready);
    assert!(matches!(
        world.machine.claim_socket(world.now, 50, standby.token.expose()),
        Err(AdmissionRefusal::Duplicate { .. })
    ));
    assert!(matches!(
        world.machine.claim_socket(world.now, 51, standby.token.expose()),
        Err(AdmissionRefusal::Duplicate { .. })
    ));
    assert_eq!(world.machine.metrics(world.now).duplicate_connections_refused, 2);
    // Exactly one socket gets the assignment.
    let (_, step) = world.submit(run("a"));
    let sent = assignments(&step);
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].0, first);
}

#[test]
fn a_silent_socket_is_closed_and_replaced_before_its_sandbox_counts_as_silent() {
    let mut world = World::new(1);
    let (standby, first) = world.ready_pool().remove(0);
    world.advance(SECOND);
    let refused = world.machine.claim_socket(world.now, 50, standby.token.expose());
    // Two intervals (1 s each) from its last heartbeat: the 409 says when.
    assert_eq!(
        refused.err(),
        Some(AdmissionRefusal::Duplicate { retry_after: Duration::from_millis(SECOND as u64 + 1) })
    );
    world.advance(SECOND);
    assert!(world.machine.claim_socket(world.now, 50, standby.token.expose()).is_err(), "live up to the window");
    world.advance(1);
    let (_, step) =
        world.machine.claim_socket(world.now, 51, standby.token.expose()).expect("the silent one is replaced");
    assert_eq!(closes(&step), [first]);
    let step = world.machine.connected(world.now, 51, (&standby_credential(&world, &standby), &standby.token), None);
    assert!(closes(&step).is_empty(), "the new socket is set up");
    assert!(world.heartbeat(first, AgentState::Ready).is_empty(), "the replaced socket speaks for no one");
    // Its first heartbeat comes before the sandbox's silence limit.
    world.heartbeat(51, AgentState::Ready);
    world.advance(SECOND);
    assert!(retires(&world.tick()).is_empty(), "the standby was never silent");
    // A late disconnect of the replaced socket frees nothing of the new one.
    world.machine.disconnected(first);
    assert!(matches!(
        world.machine.claim_socket(world.now, 52, standby.token.expose()),
        Err(AdmissionRefusal::Duplicate { .. })
    ));
}

fn standby_credential(world: &World, standby: &Launched) -> String {
    world.sandbox(&standby.sandbox_id).standby_credential_id
}

#[test]
fn a_closed_socket_or_a_failed_upgrade_frees_the_credential_at_once() {
    let mut world = World::new(1);
    let (standby, first) = world.ready_pool().remove(0);
    world.machine.disconnected(first);
    let (admission, _) = world.machine.claim_socket(world.now, 50, standby.token.expose()).expect("admitted");
    // Two upgrades at once: the claim is taken before either connects.
    assert!(matches!(
        world.machine.claim_socket(world.now, 51, standby.token.expose()),
        Err(AdmissionRefusal::Duplicate { .. })
    ));
    // The upgrade of 50 never completed: its claim goes with it.
    world.machine.disconnected(50);
    world.machine.claim_socket(world.now, 52, standby.token.expose()).expect("admitted");
    // A connection set up on a claim that is not its own is closed.
    let step = world.machine.connected(world.now, 50, (admission.credential_id(), &standby.token), None);
    assert_eq!(closes(&step), [50]);
}

#[test]
fn a_run_credential_has_one_socket_too() {
    let mut world = World::new(1);
    let (_, assignment, run_conn) = running(&mut world);
    let token = assignment.run_credential.expose();
    assert!(matches!(world.machine.claim_socket(world.now, 60, token), Err(AdmissionRefusal::Duplicate { .. })));
    world.machine.disconnected(run_conn);
    let (_, step) = world.machine.claim_socket(world.now, 61, token).expect("a reconnect");
    assert!(step.is_empty());
}

// ---- the assignment's workspace (amendment 1) ------------------------------------------

#[test]
fn the_assignment_always_names_the_workspace_the_run_expects() {
    let pool = Workspace {
        repos: vec![Repo { url: "file:///pool".into(), path: "app".into(), git_ref: None, expected_sha: None }],
        setup: Vec::new(),
    };
    let mut config = config(1);
    config.pool_workspace = pool.clone();
    config.pool_fingerprint = fingerprint(&pool);
    let mut world = World::with(config);
    world.ready_pool();
    let (_, step) = world.submit(run("a"));
    let warm = assignments(&step).remove(0).1;
    assert_eq!(warm.run.workspace.as_ref(), Some(&pool), "a pool standby: the spec's");
    // The replay on the run credential names it too.
    let (_, _, step) = world.connect(&warm.run_credential);
    assert_eq!(assignments(&step).remove(0).1.run.workspace.as_ref(), Some(&pool));
    // A run naming its own workspace, on a cold sandbox: its own.
    let own = Workspace {
        repos: vec![Repo { url: "file:///own".into(), path: "app".into(), git_ref: None, expected_sha: None }],
        setup: Vec::new(),
    };
    let mut named = run("b");
    named.workspace = Some(own.clone());
    let (_, step) = world.submit(named);
    let cold = launches(&step).remove(0);
    let (_, _, step) = world.connect(&cold.token);
    assert_eq!(assignments(&step).remove(0).1.run.workspace, Some(own));
}

// ---- refusals ----------------------------------------------------------------------

#[test]
fn refusals_distinguish_gone_from_unauthorized() {
    let mut world = World::new(1);
    let (standby, _) = world.ready_pool().remove(0);
    assert_eq!(world.machine.authenticate("sby_unknown_secret"), Err(AdmissionRefusal::Gone));
    assert_eq!(world.machine.authenticate("run_unknown_secret"), Err(AdmissionRefusal::Unauthorized));
    assert_eq!(world.machine.authenticate("not a token"), Err(AdmissionRefusal::Unauthorized));
    let (_, id, _) = {
        let text = standby.token.expose().to_owned();
        let mut parts = text.splitn(3, '_');
        (parts.next().map(str::to_owned), parts.next().map(str::to_owned).expect("an id"), ())
    };
    assert_eq!(world.machine.authenticate(&format!("sby_{id}_wrong")), Err(AdmissionRefusal::Unauthorized));
    assert_eq!(
        world.machine.authenticate(&format!("run_{id}_wrong")),
        Err(AdmissionRefusal::Unauthorized),
        "kind mismatch"
    );
}

#[test]
fn refusals_answer_the_contracts_statuses() {
    use standby_protocol::{Answer, CredentialKind, ExitCode};
    // What the agent makes of each answer, for the credential it presented.
    let cases = [
        (AdmissionRefusal::Gone, CredentialKind::Standby, 410, ExitCode::Unavailable),
        (AdmissionRefusal::Unauthorized, CredentialKind::Standby, 401, ExitCode::Unauthorized),
        (AdmissionRefusal::Unauthorized, CredentialKind::Run, 401, ExitCode::Withdrawn),
        (AdmissionRefusal::Ended, CredentialKind::Run, 410, ExitCode::Withdrawn),
    ];
    for (refusal, credential, status, exit) in cases {
        assert_eq!(refusal.status().as_u16(), status, "{refusal:?}");
        let Answer::Refused(read) = Answer::of(refusal.status().as_u16()) else { panic!("{refusal:?} is a refusal") };
        assert_eq!(read.exit(credential), exit, "{refusal:?} of a {credential:?} credential");
    }
    let duplicate = AdmissionRefusal::Duplicate { retry_after: Duration::from_secs(1) };
    assert_eq!((duplicate.contract(), duplicate.status().as_u16()), (None, 409), "a second socket, not a refusal");
}
