//! Per-run bounds as rules of the pure machine: the log cap and declared
//! gaps, the events a run records, finished runs leaving memory.

use super::*;
use standby_protocol::log_chunk::MAX_POSITION;

fn bounded(log_cap: u64, retention: Duration) -> World {
    let mut config = config(1);
    config.bounds = RunBounds { log_cap, retention, ..RunBounds::default() };
    World::with(config)
}

/// A run started on a standby: its id.
fn started(world: &mut World) -> String {
    world.ready_pool();
    let (run_id, _) = world.submit(run("a"));
    world.event(&run_id, "s", EventKind::Started);
    run_id
}

fn stored(step: &Step) -> Vec<(u64, Vec<u8>, LogLedger)> {
    step.writes
        .iter()
        .filter_map(|write| match write {
            Write::Log { offset, data, ledger, .. } => Some((*offset, data.clone(), *ledger)),
            _ => None,
        })
        .collect()
}

#[test]
fn past_the_log_cap_chunks_are_acknowledged_and_counted_not_stored() {
    let mut world = bounded(10, Duration::from_secs(60));
    let run_id = started(&mut world);
    let (step, received) = world.machine.log(&run_id, 0, 0, b"0123456").expect("under the cap");
    assert_eq!(received, 7);
    assert_eq!(stored(&step), [(0, b"0123456".to_vec(), LogLedger { received: 7, held: 7, over_cap: 0 })]);
    let (step, received) = world.machine.log(&run_id, 7, 0, b"789abc").expect("across the cap");
    assert_eq!(received, 13, "the whole chunk is acknowledged");
    assert_eq!(stored(&step), [(7, b"789".to_vec(), LogLedger { received: 13, held: 10, over_cap: 3 })]);
    let (step, received) = world.machine.log(&run_id, 13, 0, &[b'x'; 100]).expect("past the cap");
    assert_eq!(received, 113);
    assert_eq!(stored(&step), [(13, Vec::new(), LogLedger { received: 113, held: 10, over_cap: 103 })]);
    let (step, received) = world.machine.log(&run_id, 13, 0, &[b'x'; 100]).expect("a retry past the cap");
    assert_eq!((received, step.writes.len()), (113, 0), "a duplicate, not counted twice");
}

#[test]
fn a_declared_gap_is_accepted_and_recorded_and_an_undeclared_one_refused() {
    let mut world = bounded(1 << 20, Duration::from_secs(60));
    let run_id = started(&mut world);
    world.machine.log(&run_id, 0, 0, b"abc").expect("appended");
    assert_eq!(
        world.machine.log(&run_id, 10, 0, b"def").map(|(_, n)| n),
        Err(LogError::Conflict { offset: 10, dropped: 0, received: 3 })
    );
    assert_eq!(
        world.machine.log(&run_id, 10, 6, b"def").map(|(_, n)| n),
        Err(LogError::Conflict { offset: 10, dropped: 6, received: 3 }),
        "the gap must end exactly where the ledger does"
    );
    let (step, received) = world.machine.log(&run_id, 10, 7, b"def").expect("after exactly its gap");
    assert_eq!(received, 13);
    assert_eq!(stored(&step), [(10, b"def".to_vec(), LogLedger { received: 13, held: 6, over_cap: 0 })]);
}

/// Issue 25, finding 1: two chunks at 2^63 once stopped the engine (the
/// store clamped both to the same key). Past the largest position nothing
/// is kept and the ledger does not move; up to it, a chunk is kept.
#[test]
fn a_chunk_past_the_largest_stream_position_is_refused_and_changes_nothing() {
    let mut world = bounded(1 << 20, Duration::from_secs(60));
    let run_id = started(&mut world);
    assert_eq!(
        world.machine.log(&run_id, 1 << 63, 1 << 63, b"x").map(|(_, n)| n),
        Err(LogError::OutOfRange { field: "dropped" })
    );
    assert_eq!(
        world.machine.log(&run_id, MAX_POSITION, 0, b"x").map(|(_, n)| n),
        Err(LogError::OutOfRange { field: "offset" })
    );
    assert_eq!(world.machine.log_ledger(&run_id), LogLedger::default(), "the ledger did not move");
    let (step, received) =
        world.machine.log(&run_id, MAX_POSITION - 1, MAX_POSITION - 1, b"x").expect("up to the largest");
    assert_eq!(received, MAX_POSITION);
    assert_eq!(
        stored(&step),
        [(MAX_POSITION - 1, b"x".to_vec(), LogLedger { received: MAX_POSITION, held: 1, over_cap: 0 })]
    );
    assert_eq!(
        world.machine.log(&run_id, MAX_POSITION, 0, b"y").map(|(_, n)| n),
        Err(LogError::OutOfRange { field: "offset" }),
        "nothing goes past it"
    );
    assert_eq!(
        world.machine.log(&run_id, MAX_POSITION, 0, b"").map(|(_, n)| n),
        Ok(MAX_POSITION),
        "an empty chunk at the end"
    );
}

#[test]
fn a_run_records_a_bounded_number_of_events_and_still_obeys_them() {
    let mut world = bounded(1 << 20, Duration::from_secs(60));
    let run_id = started(&mut world);
    for n in 0..MAX_EVENTS_PER_RUN * 2 {
        world.event(&run_id, &format!("again-{n}"), EventKind::Started);
    }
    let recorded = world.writes.iter().filter(|write| matches!(write, Write::Event(e) if e.run_id == run_id)).count();
    assert_eq!(recorded, MAX_EVENTS_PER_RUN);
    world.event(&run_id, "x", EventKind::Exited { code: 3 });
    assert_eq!(world.run(&run_id).exit_code, Some(3), "an event past the bound still acts");
}

#[test]
fn finished_runs_leave_memory_after_the_retention_window_and_stay_counted() {
    let mut world = bounded(1 << 20, Duration::from_secs(60));
    let run_id = started(&mut world);
    world.machine.log(&run_id, 0, 0, b"out").expect("appended");
    world.event(&run_id, "x", EventKind::Exited { code: 0 });
    world.advance(59 * SECOND);
    world.tick();
    assert!(world.machine.run(&run_id).is_some(), "kept within the window");
    world.advance(SECOND);
    world.tick();
    assert!(world.machine.run(&run_id).is_none(), "evicted after it");
    assert_eq!(world.machine.runs_in_memory(), 0);
    let metrics = world.machine.metrics(world.now);
    assert_eq!(metrics.runs.get(&(RunState::Exited, Some(RunPath::Warm))), Some(&1));
    assert_eq!(metrics.runs_in_memory, 0);
    assert_eq!(metrics.start_times.submit_to_start[&RunPath::Warm].count(), 1, "its start time stays counted");
    // Its agent's late calls are acknowledged and dropped: nothing grows.
    let late = Event::new("late", EventKind::Started);
    assert!(world.machine.event(world.now, &run_id, 1, late).is_empty());
    let (step, received) = world.machine.log(&run_id, 3, 0, b"late").expect("acknowledged");
    assert_eq!((received, step.writes.len()), (7, 0));
    // A restart loads no finished run, and counts them all the same.
    let restored = Rules::restore(config(1), Box::new(CountingMint::default()), world.snapshot(), world.now).0;
    assert_eq!(restored.runs_in_memory(), 0);
    assert_eq!(restored.metrics(world.now).runs.get(&(RunState::Exited, Some(RunPath::Warm))), Some(&1));
}

#[test]
fn a_thread_turn_whose_previous_turn_left_memory_is_not_held_up() {
    let mut world = bounded(1 << 20, Duration::from_secs(1));
    world.ready_pool();
    let (first, _) = {
        let (step, id) = world.machine.submit_turn(world.now, run("t1"), request(), Some("th".into()));
        (id, world.keep(step))
    };
    world.event(&first, "s", EventKind::Started);
    world.event(&first, "x", EventKind::Exited { code: 0 });
    world.advance(2 * SECOND);
    world.tick();
    assert!(world.machine.run(&first).is_none());
    let (step, second) = world.machine.submit_turn(world.now, run("t2"), request(), Some("th".into()));
    world.keep(step);
    assert_ne!(world.run(&second).state, RunState::Waiting, "no finished turn holds the thread");
}
