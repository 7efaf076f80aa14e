//! Threads: the pointer, parking, and the auto-stop of kept sandboxes.

use super::*;

#[test]
fn two_turns_of_a_thread_never_hold_its_sandbox_at_once() {
    let mut world = World::with(policy(0, 8));
    let Bound { run_id: first, assignment, sandbox_id, .. } = bound_turn(&mut world, "t1");
    let (second, step) = turn(&mut world, "t1");
    let waiting = world.run(&second);
    assert_eq!(waiting.state, RunState::Waiting);
    assert!(waiting.wait.as_ref().is_some_and(|w| w.reason.contains(&first) && !w.for_slot));
    assert!(launches(&step).is_empty());
    // Other threads are not held up.
    let (other, _) = turn(&mut world, "t2");
    assert_eq!(world.run(&other).state, RunState::Committed);
    finish(&mut world, &assignment);
    let step = exited(&mut world, &sandbox_id);
    let (_, token, _) = resumes(&step).remove(0);
    ready(&mut world, &token);
    let run = world.run(&second);
    assert_eq!(run.path(), Some(RunPath::ParkedRunning));
    assert_eq!(run.current().expect("bound").sandbox_id, sandbox_id);
    assert_eq!(world.machine.thread("t1").and_then(|t| t.holder.clone()), Some(second));
}

#[test]
fn a_stale_pointer_write_is_rejected() {
    let mut world = World::with(policy(0, 8));
    let Bound { run_id: first, assignment, sandbox_id, .. } = bound_turn(&mut world, "t1");
    let held = world.run(&first).thread_generation.expect("the turn holds the pointer");
    // Another writer (a second server on the store) moves the pointer on.
    let mut step = Step::default();
    world
        .machine
        .write_thread(world.now, &mut step, "t1", held, |thread| {
            thread.sandbox_id = Some("sbx_elsewhere".into());
            thread.holder = Some("exe_elsewhere".into());
        })
        .expect("the current generation is accepted");
    world.keep(step);
    // A write that read the old generation is refused...
    let mut step = Step::default();
    let stale = world.machine.write_thread(world.now, &mut step, "t1", held, |thread| thread.holder = None);
    assert_eq!(stale, Err(StalePointer { thread_id: "t1".into(), expected: held, found: held + 1 }));
    assert!(step.writes.is_empty());
    // ...and so is the late turn's park: its sandbox is released instead.
    let step = finish(&mut world, &assignment);
    assert_eq!(retires(&step), std::slice::from_ref(&sandbox_id));
    assert!(parks(&step).is_empty());
    assert!(world.sandbox(&sandbox_id).retire_reason.is_some_and(|r| r.contains("generation")));
    let pointer = world.machine.thread("t1").expect("a pointer");
    assert_eq!(pointer.sandbox_id.as_deref(), Some("sbx_elsewhere"), "the newer pointer stands");
    assert_eq!(pointer.generation, held + 1);
}

#[test]
fn at_the_cap_the_oldest_parked_running_sandbox_makes_room_for_a_waiting_run() {
    for park_stopped in [true, false] {
        let mut config = policy(0, 2);
        config.pool_policy.park_stopped = park_stopped;
        let mut world = World::with(config);
        let oldest = parked_running(&mut world, "a");
        world.advance(SECOND);
        let newer = parked_running(&mut world, "b");
        let (waiting, step) = world.submit(run("c"));
        assert_eq!(world.run(&waiting).state, RunState::Waiting);
        if park_stopped {
            assert_eq!(stops(&step), std::slice::from_ref(&oldest));
            assert_eq!(park_mode(&world, &oldest), Some(ParkMode::Stopped));
        } else {
            assert_eq!(retires(&step), std::slice::from_ref(&oldest), "released");
        }
        assert_eq!(park_mode(&world, &newer), Some(ParkMode::Running));
        let step = exited(&mut world, &oldest);
        assert_eq!(launches(&step).len(), 1);
        assert_eq!(world.run(&waiting).path(), Some(RunPath::Cold));
    }
}

#[test]
fn a_kept_sandbox_gets_an_auto_stop_above_the_warm_window() {
    for (window_s, configured, expected) in [(900, 15, 20), (125, 1, 8), (300, 0, 0), (300, 60, 60)] {
        let mut config = policy(0, 8);
        config.pool_policy.warm_idle = Duration::from_secs(window_s);
        config.pool_policy.auto_stop = AutoStop { minutes: configured, minute: MINUTE };
        let mut world = World::with(config);
        let Bound { step, assignment, sandbox_id, .. } = bound_turn(&mut world, "t1");
        assert!(
            step.effects.iter().any(|e| matches!(e, Effect::Launch { auto_stop, .. } if *auto_stop == configured)),
            "a cold sandbox is created with the configured auto-stop"
        );
        let step = finish(&mut world, &assignment);
        assert_eq!(parks(&step), [(sandbox_id.clone(), expected)], "window {window_s} s, configured {configured}");
        let step = exited(&mut world, &sandbox_id);
        assert_eq!(resumes(&step)[0].2, expected, "and the resume keeps it");
    }
}
