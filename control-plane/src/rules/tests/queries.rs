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
    let metrics = world.machine.metrics();
    assert_eq!(metrics.runs.get(&(RunState::Running, Some(RunPath::Warm))), Some(&1));
    assert_eq!(metrics.runs.get(&(RunState::Committed, Some(RunPath::Cold))), Some(&1));
    assert_eq!(metrics.assignment_to_start_ms, [250]);
    assert_eq!(metrics.connected_standbys, 1);
    let _ = (cold, conn);
}
