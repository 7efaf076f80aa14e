//! Control sockets: withheld and replayed assignments, delivery confirmation.

use super::*;

/// Telling a cold sandbox its assignment starts delivery confirmation,
/// which revokes the standby credential: an agent still fetching its spec
/// with that credential would be refused. So the assignment waits until the
/// spec was served, or the agent says it is past preparing.
#[test]
fn a_cold_sandbox_is_told_only_once_its_agent_has_its_spec() {
    for how in ["spec", "ready"] {
        let mut world = World::new(0);
        let (run_id, step) = world.submit(run("a"));
        let cold = launches(&step).remove(0);
        let (_, conn, step) = world.connect_only(&cold.token);
        assert!(assignments(&step).is_empty(), "withheld while the agent may be fetching its spec");
        let step = world.heartbeat(conn, AgentState::Preparing);
        assert!(assignments(&step).is_empty());
        let step = match how {
            "spec" => {
                let step = world.machine.spec_served(&cold.sandbox_id);
                world.keep(step)
            }
            _ => world.heartbeat(conn, AgentState::Ready),
        };
        let sent = assignments(&step);
        assert_eq!((sent.len(), sent[0].0), (1, conn), "{how}");
        assert_eq!(sent[0].1.execution_id, run_id);
        let step = world.heartbeat(conn, AgentState::Ready);
        assert!(assignments(&step).is_empty(), "sent once");
    }
}

#[test]
fn the_assignment_is_sent_again_on_a_later_standby_connection_until_confirmed() {
    let mut world = World::new(1);
    let (standby, conn) = world.ready_pool().remove(0);
    let (_, step) = world.submit(run("a"));
    let first = assignments(&step).remove(0).1;
    world.machine.disconnected(conn);
    let (_, _, step) = world.connect(&standby.token);
    let again = assignments(&step).remove(0).1;
    assert_eq!(again, first, "the same execution and credential");
}

#[test]
fn assignment_sent_is_stamped_once() {
    let mut world = World::new(1);
    world.ready_pool();
    let (run_id, _) = world.submit(run("a"));
    world.advance(5);
    assert!(!world.machine.assignment_sent(world.now, &run_id).is_empty());
    let sent = world.run(&run_id).current().and_then(|a| a.assignment_sent_at);
    world.advance(5);
    assert!(world.machine.assignment_sent(world.now, &run_id).is_empty());
    assert_eq!(world.run(&run_id).current().and_then(|a| a.assignment_sent_at), sent);
}

#[test]
fn the_run_credential_connecting_revokes_the_standby_credential_and_replays_the_assignment() {
    let mut world = World::new(1);
    let Warm { standby, conn: standby_conn, run_id, assignment } = world.warm_run();
    world.advance(7);
    let (admission, run_conn, step) = world.connect(&assignment.run_credential);
    assert!(matches!(admission, Admission::Run { .. }));
    let standby_credential = world.sandbox(&standby.sandbox_id).standby_credential_id;
    let revoked = position(&step, revokes(&standby_credential));
    assert!(revoked < step.writes.len());
    assert_eq!(closes(&step), [standby_conn]);
    let replay = sends(&step, run_conn);
    assert_eq!(replay, [ServerMessage::Assignment(Box::new(assignment.clone()))]);
    let record = world.run(&run_id);
    assert_eq!(record.state, RunState::Confirmed);
    assert_eq!(record.current().and_then(|a| a.delivery_confirmed_at), Some(world.now));
    assert_eq!(world.machine.authenticate(standby.token.expose()), Err(AdmissionRefusal::Unauthorized));
    // A reconnection with the run credential gets the replay again.
    world.machine.disconnected(run_conn);
    let (_, again, step) = world.connect(&assignment.run_credential);
    assert_eq!(sends(&step, again), [ServerMessage::Assignment(Box::new(assignment))]);
    assert_eq!(
        world.run(&run_id).current().and_then(|a| a.delivery_confirmed_at),
        record.current().and_then(|a| a.delivery_confirmed_at)
    );
}

#[test]
fn a_connection_whose_credential_was_revoked_meanwhile_is_closed() {
    let mut world = World::new(1);
    let (standby, first) = world.ready_pool().remove(0);
    let (run_id, _) = world.submit(run("a"));
    assert_eq!(world.run(&run_id).path(), Some(RunPath::Warm));
    // Its agent reconnects: the new upgrade is admitted, then the
    // credential is revoked before the connection is set up.
    world.machine.disconnected(first);
    let (admission, _) = world.machine.claim_socket(world.now, 99, standby.token.expose()).expect("admitted");
    world.machine.cancel(world.now, &run_id).expect("cancelled");
    let step = world.machine.connected(world.now, 99, (admission.credential_id(), &standby.token), None);
    assert_eq!(closes(&step), [99]);
}

/// A heartbeat that changes nothing writes nothing: thousands of standbys
/// heartbeating cost the store no transaction (with nothing to tell, the
/// engine does not even check the lease).
#[test]
fn a_routine_heartbeat_of_a_ready_standby_writes_and_tells_nothing() {
    let mut world = World::new(3);
    let pool = world.ready_pool();
    assert_eq!(pool.len(), 3);
    for round in 0..3 {
        world.advance(1000);
        for (_, conn) in &pool {
            let step = world.heartbeat(*conn, AgentState::Ready);
            assert!(step.writes.is_empty() && step.effects.is_empty(), "round {round}: {step:?}");
        }
    }
}

/// A replicated deployment records which replica holds an agent's socket
/// (with the leader's epoch) in the sandbox's record, written with the
/// connection count it writes anyway.
#[test]
fn the_replica_holding_a_socket_is_recorded_with_its_connection() {
    let mut world = World::new(1);
    let standby = launches(&world.tick()).remove(0);
    let conn = world.next_conn;
    world.next_conn += 1;
    let (admission, _) = world.machine.claim_socket(world.now, conn, standby.token.expose()).expect("admitted");
    let holder = crate::model::Holder { replica: "r2".into(), epoch: 7 };
    let step =
        world.machine.connected(world.now, conn, (admission.credential_id(), &standby.token), Some(holder.clone()));
    let written: Vec<_> = step
        .writes
        .iter()
        .filter_map(|write| match write {
            Write::Sandbox(record) => Some(record.held_by.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(written, [Some(holder)]);
}

fn traced(step: &Step) -> Vec<&RunRecord> {
    step.effects
        .iter()
        .filter_map(|effect| match effect {
            Effect::Traced(run) => Some(run.as_ref()),
            _ => None,
        })
        .collect()
}

/// Traced, the assignment names its attempt's delivery span as the agent's
/// parent (the replay the same), and the run is handed over for its spans
/// once, when `started` is first recorded. Untraced, neither happens.
#[test]
fn a_traced_run_carries_its_delivery_span_and_is_handed_over_once_started() {
    let mut config = config(1);
    config.trace = true;
    let mut world = World::with(config);
    let Warm { run_id, assignment, .. } = world.warm_run();
    let context = assignment.trace_context.clone().expect("traced");
    let parent = context.parent().expect("well formed");
    assert_eq!(parent.trace_id, crate::rules::trace::trace_id(&run_id));
    assert_eq!(parent.parent_id, crate::rules::trace::delivery_span_id(&run_id, 1));
    let (_, run_conn, step) = world.connect(&assignment.run_credential);
    assert_eq!(
        sends(&step, run_conn),
        [ServerMessage::Assignment(Box::new(assignment))],
        "the replay names the same span"
    );
    let step = world.event(&run_id, "s1", EventKind::Started);
    let handed = traced(&step);
    assert_eq!(handed.len(), 1);
    assert!(handed[0].current().is_some_and(|attempt| attempt.started_at.is_some()));
    assert!(traced(&world.event(&run_id, "s2", EventKind::Started)).is_empty(), "once");

    let mut world = World::new(1);
    let Warm { run_id, assignment, .. } = world.warm_run();
    assert_eq!(assignment.trace_context, None);
    world.connect(&assignment.run_credential);
    assert!(traced(&world.event(&run_id, "s1", EventKind::Started)).is_empty());
}
