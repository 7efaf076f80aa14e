//! Idempotent submission as a rule of the pure machine: a key makes one
//! run, in the same step as the run; a retry answers it; another body is
//! refused; the window forgets the key, in memory and in the store, and a
//! restart remembers it.

use super::*;

fn key(hash: &str) -> Option<IdempotencyKey> {
    Some(IdempotencyKey { key: "retry-1".into(), request_hash: hash.into() })
}

fn keyed(world: &mut World, hash: &str) -> Result<Submitted, KeyReused> {
    let (step, submitted) = world.machine.submit_keyed(world.now, run("a"), request(), None, key(hash))?;
    world.keep(step);
    Ok(submitted)
}

#[test]
fn a_key_makes_one_run_committed_with_it() {
    let mut world = World::new(0);
    let (step, submitted) =
        world.machine.submit_keyed(world.now, run("a"), request(), None, key("h1")).expect("a new key");
    let Submitted::New(run_id) = submitted else { panic!("a new run") };
    let new_run = position(&step, |write| matches!(write, Write::NewRun(run, _) if run.id == run_id));
    let kept = position(&step, |write| matches!(write, Write::Idempotency(kept) if kept.run_id == run_id));
    assert!(new_run < step.writes.len() && kept < step.writes.len(), "one step, so one transaction");
    world.keep(step);
    assert_eq!(keyed(&mut world, "h1"), Ok(Submitted::Replayed(run_id.clone())));
    assert_eq!(keyed(&mut world, "h2"), Err(KeyReused { run_id: run_id.clone() }));
    assert_eq!(world.machine.runs().count(), 1, "a retry makes no run");
    // Without a key, the same body is another run.
    world.submit(run("a"));
    assert_eq!(world.machine.runs().count(), 2);
}

#[test]
fn a_restart_remembers_the_key_and_the_window_forgets_it() {
    let mut world = World::new(0);
    let Ok(Submitted::New(run_id)) = keyed(&mut world, "h1") else { panic!("a new run") };
    let (mut restored, _) =
        Rules::restore(config(0), Box::new(CountingMint::starting_at(1000)), world.snapshot(), world.now);
    let replay = restored.submit_keyed(world.now, run("a"), request(), None, key("h1")).expect("the same body");
    assert_eq!(replay.1, Submitted::Replayed(run_id));
    world.advance(i64::try_from(RunBounds::default().idempotency_window.as_millis()).expect("fits") - 1);
    assert!(!world.tick().writes.iter().any(|write| matches!(write, Write::ForgetIdempotency { .. })));
    assert!(matches!(keyed(&mut world, "h2"), Err(KeyReused { .. })), "still within the window");
    world.advance(1);
    let step = world.tick();
    assert!(step.writes.iter().any(|write| matches!(write, Write::ForgetIdempotency { .. })));
    assert!(world.snapshot().idempotency.is_empty(), "forgotten in the store too");
    assert!(matches!(keyed(&mut world, "h2"), Ok(Submitted::New(_))), "a forgotten key makes a new run");
}

#[test]
fn a_key_past_its_window_makes_a_new_run_before_any_tick_forgets_it() {
    let mut world = World::new(0);
    let Ok(Submitted::New(first)) = keyed(&mut world, "h1") else { panic!("a new run") };
    world.advance(i64::try_from(RunBounds::default().idempotency_window.as_millis()).expect("fits"));
    let Ok(Submitted::New(second)) = keyed(&mut world, "h1") else { panic!("a new run: the key was past its window") };
    assert_ne!(first, second);
    let kept = world.snapshot().idempotency;
    assert_eq!(kept.iter().map(|kept| kept.run_id.as_str()).collect::<Vec<_>>(), [second.as_str()]);
}
