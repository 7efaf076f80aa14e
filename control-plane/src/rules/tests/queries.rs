//! What `/metrics` reads.

use super::*;

#[test]
fn metrics_count_runs_by_state_and_path() {
    let mut world = World::new(1);
    let (_, conn) = world.ready_pool().remove(0);
    let (warm, _) = world.submit(run("a"));
    let (cold, _) = world.submit(run("b"));
    world.advance(10);
    world.machine.assignment_sent(world.now, &warm);
    world.advance(250);
    world.event(&warm, "s", EventKind::Started);
    let metrics = world.machine.metrics(world.now);
    assert_eq!(metrics.runs.get(&(RunState::Running, Some(RunPath::Warm))), Some(&1));
    assert_eq!(metrics.runs.get(&(RunState::Committed, Some(RunPath::Cold))), Some(&1));
    assert_eq!(metrics.assignment_to_start_ms, [250]);
    assert_eq!(metrics.connected_standbys, 1);
    let _ = (cold, conn);
}

#[test]
fn metrics_time_each_phase_of_a_start_by_path_and_count_ready_standbys_against_the_target() {
    let mut world = World::new(2);
    let Warm { run_id, assignment, .. } = world.warm_run();
    let submitted = world.run(&run_id).submitted_at;
    let committed = world.run(&run_id).current().map(|a| a.committed_at).expect("attempt");
    world.advance(10);
    world.machine.assignment_sent(world.now, &run_id);
    world.advance(20);
    world.connect(&assignment.run_credential);
    world.advance(30);
    world.event(&run_id, "s", EventKind::Started);
    let metrics = world.machine.metrics(world.now);
    assert_eq!((metrics.ready_standbys, metrics.pool_target), (1, 2), "one of two standbys took the run");
    let warm = &metrics.start_times.submit_to_start[&RunPath::Warm];
    assert_eq!((warm.count(), warm.sum_ms()), (1, world.now.since(submitted)));
    let phase = |phase| metrics.start_times.phases[&(RunPath::Warm, phase)].sum_ms();
    assert_eq!(phase(Phase::Queued), committed.since(submitted));
    assert_eq!(phase(Phase::CommitToAssignmentSent), world.now.since(committed) - 50);
    assert_eq!(phase(Phase::AssignmentSentToDeliveryConfirmed), 20);
    assert_eq!(phase(Phase::DeliveryConfirmedToStarted), 30);
    assert!(!metrics.start_times.submit_to_start.contains_key(&RunPath::Cold), "no cold run started");
}
